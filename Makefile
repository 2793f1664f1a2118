# Every target sets itself up first (scripts/setup is a no-op when nothing changed).
# make test M=m05   runs only the tests of one milestone.
# make setup-cuda   installs the CUDA build of torch (scripts/setup picks it by itself where
#                   `nvidia-smi` lists a GPU; the CPU-only build everywhere else).

M ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup setup-cuda check test test-slow test-integration docs docs-serve serve reference

setup:
	scripts/setup

setup-cuda:
	NANOLLMSERVE_TORCH=cuda scripts/setup

check:
	scripts/check

test:
	M="$(M)" scripts/test

# The long end-to-end tests (marked slow: soaks, fuzzing, clusters, benchmark-like runs, the
# HF reference generations, the compatibility matrix's feature-pair tests), kept out of
# `make test`'s ten minutes; CI runs them too. Selecting none (M=...) is not a failure
# outside CI.
test-slow:
	M="$(M)" scripts/test -m "slow and not integration" || { rc=$$?; [ $$rc -eq 5 ] && [ -z "$${CI:-}" ]; }

# Tests that need external programs: a real Prometheus scraping a live server, the playground
# in Chromium (scripts/setup-integration installs them first). Outside CI a missing program
# skips its tests and selecting none is not a failure; in CI (CI set) both are failures.
test-integration:
	scripts/setup-integration
	M="$(M)" scripts/test -m integration || { rc=$$?; [ $$rc -eq 5 ] && [ -z "$${CI:-}" ]; }

# Regenerate docs/reference/ (serve flags, bench subcommands, metrics, endpoints) from the code.
reference: setup
	.venv/bin/python scripts/gen_reference.py

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# Serving needs only the runtime dependencies (no dev or cluster extras).
serve:
	scripts/setup --runtime
	.venv/bin/nanollmserve serve --host $(HOST) --port $(PORT)
