"""`scripts/check_docs.py` (so `make check`) fails when the compatibility matrix loses its
evidence: a cell with no test, a named test that does not exist, or a page that is no longer
what scripts/compat_matrix.py generates. Runs the check on a copy of the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.milestone("m00"), pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parent.parent
CELL_LINE = '    ("grpc", "cuda"): not_run(NO_GPU),\n'


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns(".venv", ".git", "site", "*_cache", "__pycache__", "src")
    shutil.copytree(REPO_ROOT, copy, ignore=ignore)
    return copy


def check_docs(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "check_docs.py"), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_committed_matrix_passes(repo: Path) -> None:
    result = check_docs(repo)
    assert "compat_matrix" not in result.stdout, result.stdout


def test_a_pair_without_a_cell_fails(repo: Path) -> None:
    edit(repo / "scripts" / "compat_matrix.py", CELL_LINE, "")
    result = check_docs(repo)
    assert result.returncode == 1
    assert "compat_matrix: gRPC x CUDA: no cell" in result.stdout


def test_not_run_outside_cuda_fails(repo: Path) -> None:
    edit(
        repo / "scripts" / "compat_matrix.py",
        '    ("lora", "router"): works(',
        '    ("lora", "router"): not_run("later") or works(',
    )
    result = check_docs(repo)
    assert "compat_matrix: LoRA x Router: 'not run' is only allowed" in result.stdout


def test_a_named_test_that_is_gone_fails(repo: Path) -> None:
    edit(
        repo / "tests" / "test_compat_refusals.py",
        "def test_the_router_has_no_grpc_port(",
        "def test_renamed(",
    )
    result = check_docs(repo)
    assert result.returncode == 1
    assert "no test function test_the_router_has_no_grpc_port" in result.stdout


def test_a_stale_page_fails(repo: Path) -> None:
    page = repo / "docs" / "features" / "compatibility.md"
    text = page.read_text()
    stale = re.sub(r"⛔ (\d+)", r"✅ \1", text, count=1)  # one refused cell marked as working
    assert stale != text
    page.write_text(stale)
    result = check_docs(repo)
    assert result.returncode == 1
    assert "docs/features/compatibility.md: out of date" in result.stdout
