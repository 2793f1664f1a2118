"""Two checks of scripts/check_docs.py that keep milestone boxes and feature pages true
(m29, issue 42), each shown failing on the text issue 42 found false:

- a checked milestone box whose own text says it "no longer" holds or is "not met";
- a feature page saying two features do not run together ("not with", "not supported",
  "cannot be used with") where the compatibility matrix (scripts/compat_matrix.py) says the
  pair works.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.milestone("m29"), pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_docs = _script("check_docs")
CELLS = _script("compat_matrix").CELLS


def test_a_checked_box_that_says_it_no_longer_holds_fails() -> None:
    old_m16 = (
        "## TODO\n\n"
        "- [x] n-gram proposer\n"
        "- [x] copy workload >= 1.5x (issue 13): **1.585x** on a quiet machine\n"
        "  (at git a105585). **No longer holds on the default path**: since the native\n"
        "  GGUF decode step a one-token step is far cheaper\n"
        "- [ ] a target not met yet: an open box may say so\n"
        "- [x] First start: 7.2 s (target <= 5 s not met)\n"
    )
    assert check_docs.retracted_boxes(old_m16) == [
        (4, "a checked box says 'No longer': open it, or fix it"),
        (8, "a checked box says 'not met': open it, or fix it"),
    ]
    assert check_docs.retracted_boxes("- [x] the target is met\n  no caveat\n") == []


def test_a_refusal_of_a_pair_the_matrix_says_works_fails() -> None:
    """Issue 42: features/lora.md and features/quantization.md said LoRA cannot run with the
    GGUF default; the matrix cell GGUF blocks x LoRA is "works", backed by a test."""
    assert CELLS[("gguf", "lora")].state == "works"
    old_lora = (
        "- Not with `--quantization` or tensor parallelism yet (refused); gRPC calls get the\n"
        "  base model (its request has no `model` field).\n"
    )
    (found,) = check_docs.refusal_wording(old_lora, ("lora",), CELLS)
    assert found[0] == 1 and "lora and gguf do not run together" in found[1]
    old_quantization = "- Not with LoRA adapters or tensor parallelism yet: refused.\n"
    (found,) = check_docs.refusal_wording(old_quantization, ("gguf", "int8"), CELLS)
    assert "gguf and lora" in found[1]
    # True refusals pass: int8 x LoRA and tensor parallelism x LoRA are refused cells.
    fixed = (
        "- `--quantization int8` with LoRA is not supported; not with tensor parallelism.\n"
        "- Sleep level 1 works with LoRA; level 2 is not supported with LoRA adapters.\n"
    )
    assert check_docs.refusal_wording(fixed, ("lora",), CELLS) == []


def test_the_repository_passes_both_checks() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_docs.py")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    problems = [
        line
        for line in result.stdout.splitlines()
        if "checked box" in line or "run together" in line
    ]
    assert problems == []


def test_a_headline_number_names_its_commit_cpu_kernels_and_peer_flags() -> None:
    """Issue 42: a headline ratio names the CPU, the ISA level (the kernels it ran), the
    commit and, against llama.cpp, the peer's build flags."""
    old_lora = (
        "From Benchmarks: LoRA (`nanollmserve bench lora --rounds 3`,\n"
        "git 901bc66, a loaded 2-core CPU): mixed adapters ran at **0.737x** the base model.\n"
    )
    (found,) = check_docs.headline_problems(old_lora)
    assert found[0] == 1 and "without a CPU, the kernels it ran" in found[1]
    peer = "- **4.60x** llama-server's output tok/s (git 50e60fa, Intel Xeon, the `amx` build)\n"
    (found,) = check_docs.headline_problems(peer)
    assert "the llama.cpp peer's build flags" in found[1]
    complete = peer.replace("build)", "build; llama-server built with AMX off)")
    assert check_docs.headline_problems(complete) == []
    table_row = "| c32 | **4.60x** |\n"  # tables are the generated or recorded ones
    assert check_docs.headline_problems(table_row) == []


def test_the_block_type_table_follows_the_kernels() -> None:
    """docs/features/quantization.md's GGUF block types against the types a kernel runs: the
    committed page passes; the page as it was before the K-quants reached the load path
    (Q4_K ... "falls back") fails, and so does a table missing a native type."""
    from nanollmserve.model.gguf_kquants import KQUANT_TYPES, LEGACY_TYPES

    native = {*KQUANT_TYPES, *LEGACY_TYPES}
    page = (ROOT / check_docs.BLOCK_TYPE_PAGE).read_text()
    assert check_docs.block_type_problems(page, native) == []
    old = (
        "| Q4_0, Q4_1, Q8_0 | native: the tiled block kernels |\n"
        "| Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 | falls back (dequantized weights) |\n"
    )
    problems = check_docs.block_type_problems(old, native)
    assert any("Q4_K is listed as falling back" in p for p in problems), problems
    assert any("Q6_K runs natively, but the table does not list it" in p for p in problems)
    assert check_docs.block_type_problems("| Q4_0, IQ4_XS | native |\n", {"Q4_0"}) == [
        f"{check_docs.BLOCK_TYPE_PAGE}: IQ4_XS is listed native, but no kernel runs it"
    ]
