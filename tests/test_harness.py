"""Tests of the repository harness: the docs/milestone checks and the `--milestone` option."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.milestone("m00")

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO_ROOT / "tests"

SAMPLE_TESTS = """
import pytest

@pytest.mark.milestone("m00")
def test_in_m00():
    pass

@pytest.mark.milestone("m01")
def test_in_m01():
    pass

def test_without_milestone():
    pass
"""

SAMPLE_INI = """
[pytest]
markers =
    milestone(name): the milestone (mNN) a test belongs to
"""


def test_check_docs_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "check_docs.py")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _collect(tmp_path: Path, *args: str) -> tuple[int, set[str]]:
    """Collects the sample tests with this repo's conftest loaded as a plugin."""
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    (tmp_path / "pytest.ini").write_text(SAMPLE_INI)
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider"]
        + ["--collect-only", "-q", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    node_ids = {line.split("::")[1] for line in result.stdout.splitlines() if "::" in line}
    return result.returncode, node_ids


def test_milestone_option_keeps_only_marked_tests(tmp_path: Path) -> None:
    assert _collect(tmp_path) == (0, {"test_in_m00", "test_in_m01", "test_without_milestone"})
    assert _collect(tmp_path, "--milestone", "m00") == (0, {"test_in_m00"})
    assert _collect(tmp_path, "--milestone", "m00,m01") == (0, {"test_in_m00", "test_in_m01"})
    returncode, node_ids = _collect(tmp_path, "--milestone", "m99")
    assert (returncode, node_ids) == (pytest.ExitCode.NO_TESTS_COLLECTED, set())


def _copy_repo_docs(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(
        REPO_ROOT,
        copy,
        ignore=shutil.ignore_patterns(".venv", ".git", "site", "*_cache", "__pycache__", "src"),
    )
    return copy


def _check_docs(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "check_docs.py"), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_docs_rejects_done_milestone_without_evidence(tmp_path: Path) -> None:
    root = _copy_repo_docs(tmp_path)
    # A fresh milestone (planned, open boxes, no tests), made as a contributor would make it.
    created = subprocess.run(
        ["bash", str(root / "scripts" / "new-milestone"), "99", "harness-example", "Example"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    assert _check_docs(root).returncode == 0
    milestone = root / "milestones" / "m99-harness-example.md"
    assert "\nplanned\n" in milestone.read_text()
    milestone.write_text(milestone.read_text().replace("\nplanned\n", "\ndone\n", 1))
    result = _check_docs(root)
    assert result.returncode == 1
    assert "m99 row must show status 'done'" in result.stdout
    assert "unchecked boxes" in result.stdout
    assert "no test carries" in result.stdout


def test_check_docs_rejects_unknown_marker_and_missing_section(tmp_path: Path) -> None:
    root = _copy_repo_docs(tmp_path)
    marker = "@pytest.mark." + 'milestone("m99")'  # split so this file does not match
    (root / "tests" / "test_bogus.py").write_text(
        f"import pytest\n\n{marker}\ndef test_x():\n    pass\n"
    )
    milestone = next((root / "milestones").glob("m01-*.md"))
    milestone.write_text(milestone.read_text().replace("## Out of scope", "## Not in scope"))
    result = _check_docs(root)
    assert result.returncode == 1
    assert "milestone marker 'm99' names no file" in result.stdout
    assert "missing sections: ## Out of scope" in result.stdout
