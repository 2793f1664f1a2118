"""`scripts/check_docs.py` (so `make check`) fails when the compatibility matrix loses its
evidence: a cell with no test, a named test that does not exist, or a page that is no longer
what scripts/compat_matrix.py generates; `scripts/compat_matrix.py --collect` fails when a
named test fails, is skipped, or does not show both features of its cell (or the refusal)
through tests/compat_evidence.py. Runs each check on a copy of the repository (the
`--collect` cases on a small fake test file named by one cell)."""

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
    assert result.returncode == 0, result.stdout + result.stderr


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


FAKE_TESTS = """
import pytest


def test_shows_both(compat):
    compat.exercised("lora", output=[1, 2], base=[1, 3])
    compat.exercised("router", routed=1)


def test_shows_one(compat):
    compat.exercised("router", routed=1)


def test_fails_after_showing_both(compat):
    compat.exercised("lora", output=[1, 2], base=[1, 3])
    compat.exercised("router", routed=1)
    assert 1 + 1 == 3, "a planted failure"


def test_skipped(compat):
    pytest.skip("no machine for it")


def test_lora_that_changed_nothing(compat):
    compat.exercised("router", routed=1)
    compat.exercised("lora", output=[1, 2], base=[1, 2])


def test_refuses(compat):
    compat.refused("grpc", "router", "router: error: unrecognized arguments: --grpc-port 1")


def test_refuses_with_another_error(compat):
    compat.refused("grpc", "router", "router: error: something else")


def test_refusal_not_recorded(compat):
    pass
"""
FAKE = "tests/test_fake_compat.py::"


def name_fake_test(repo: Path, pair: tuple[str, str], test: str) -> None:
    """Make the cell `pair` name only `test` of FAKE_TESTS, and regenerate the page."""
    (repo / "tests" / "test_fake_compat.py").write_text(FAKE_TESTS)
    script = repo / "scripts" / "compat_matrix.py"
    text = script.read_text()
    start = text.index(f"    {pair!r}: ".replace("'", '"'))
    end = text.index("\n    (", start)  # the next cell
    cell = text[start:end]
    state = "works" if "works(" in cell else "refused"
    error = '"unrecognized arguments: --grpc-port", ' if state == "refused" else ""
    new = f'    {pair!r}: {state}({error}"{FAKE}{test}"),'.replace("'", '"')
    script.write_text(text[:start] + new + text[end:])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def collect(repo: Path, cell: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(repo / "scripts" / "compat_matrix.py"), "--collect", "--cell", cell],
        capture_output=True,
        text=True,
        timeout=100,
    )


COLLECT_CASES = [
    (("lora", "router"), "test_shows_both", None),
    (("lora", "router"), "test_shows_one", "passed without showing lora"),
    (("lora", "router"), "test_fails_after_showing_both", "failed"),
    (("lora", "router"), "test_skipped", "skipped"),
    (("lora", "router"), "test_lora_that_changed_nothing", "failed"),
    (("grpc", "router"), "test_refuses", None),
    (("grpc", "router"), "test_refusal_not_recorded", "passed without recording the refusal"),
    (("grpc", "router"), "test_refuses_with_another_error", "no test saw the error"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pair", "test", "problem"), COLLECT_CASES, ids=[c[1] for c in COLLECT_CASES]
)
def test_collect_runs_the_tests_and_checks_their_evidence(repo: Path, pair, test, problem):
    name_fake_test(repo, pair, test)
    result = collect(repo, ",".join(pair))
    output = result.stdout + result.stderr
    if problem is None:
        assert result.returncode == 0, output
        assert "compat_matrix: ran 1 tests of 1 cells" in result.stdout
        return
    assert result.returncode == 1, output
    cell = "LoRA x Router" if pair == ("lora", "router") else "gRPC x Router"
    lines = [line for line in result.stdout.splitlines() if line.startswith("compat_matrix: ")]
    assert any(cell in line and problem in line for line in lines), output
    if problem != "no test saw the error":
        assert any(f"{FAKE}{test}" in line for line in lines), output


@pytest.mark.parametrize(
    ("test", "problem"),
    [("test_shows_both", None), ("test_shows_one", "passed without showing lora")],
)
def test_collect_checks_the_evidence_a_test_run_wrote(repo: Path, tmp_path: Path, test, problem):
    """`--collect --evidence F`: what CI runs after `make test` (COMPAT_EVIDENCE=F), so the
    named tests are not run twice; the file decides, as a run of its own would."""
    name_fake_test(repo, ("lora", "router"), test)
    evidence = tmp_path / "evidence.json"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--compat-evidence", str(evidence), f"{FAKE}{test}"],
        cwd=repo, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    script = str(repo / "scripts" / "compat_matrix.py")
    result = subprocess.run(
        [sys.executable, script, "--collect", "--cell", "lora,router", "--evidence", str(evidence)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert "compat_matrix: read the evidence of 1 tests of 1 cells" in result.stdout
    if problem is None:
        assert result.returncode == 0, result.stdout
    else:
        assert result.returncode == 1 and problem in result.stdout, result.stdout
    missing = subprocess.run(
        [sys.executable, script, "--collect", "--evidence", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert missing.returncode == 2 and "no evidence file" in missing.stdout
