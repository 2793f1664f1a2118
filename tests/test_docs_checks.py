"""The checks that keep the docs true (issue 24): size suffixes of `--kv-cache-memory`, the
command lines of the docs parsed by the real CLI, the reference pages generated from the code,
stale "planned" wording about done milestones, a history entry per commit and the provenance
of benchmark JSON. Each check is shown to fail on the text that was wrong before it existed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanollmserve.cli.main import build_parser
from nanollmserve.sizes import parse_size

pytestmark = [pytest.mark.milestone("m00"), pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"
GiB, MiB = 1024**3, 1024**2


def _script(name: str):
    """A module of scripts/ (they are files, not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=90, **kwargs
    )


# -- --kv-cache-memory sizes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * GiB), ("512MiB", 512 * MiB), ("1G", GiB), ("1.5GB", 1_500_000_000),
     ("4096", 4096), ("8 mib", 8 * MiB), ("64KiB", 64 * 1024), ("1TiB", 1024**4)],
)  # fmt: skip
def test_parse_size_reads_suffixes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_kv_cache_memory_flag_and_variable_take_sizes(monkeypatch) -> None:
    """docs/distributed.md passes `--kv-cache-memory 2GiB`; the flag took only an int."""
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB"])
    assert args.kv_cache_memory == 2 * GiB
    monkeypatch.setenv("NANOLLMSERVE_KV_CACHE_MEMORY", "512MiB")
    assert build_parser().parse_args(["serve"]).kv_cache_memory == 512 * MiB


@pytest.mark.parametrize("value", ["lots", "2XB", "-1GiB", "GiB", ""])
def test_a_bad_size_fails_in_one_line_naming_the_flag(value: str) -> None:
    result = _run(
        "-m", "nanollmserve.cli.main", "serve", "--port", "0", f"--kv-cache-memory={value}"
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "argument --kv-cache-memory: invalid size" in lines[-1], result.stderr
    assert "512MiB" in lines[-1]  # it names the accepted forms


@pytest.mark.timeout(300)
def test_offline_engine_sizes_its_pool_from_a_size_string(make_llm) -> None:
    by_bytes = make_llm(num_kv_blocks=None, kv_cache_memory=8 * MiB)
    by_size = make_llm(num_kv_blocks=None, kv_cache_memory="8MiB")
    assert by_size.engine.num_kv_blocks == by_bytes.engine.num_kv_blocks > 0


# -- command lines in the docs ----------------------------------------------------------------


def test_every_doc_command_line_parses() -> None:
    result = _run(str(SCRIPTS / "check_doc_commands.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "command lines parse" in result.stdout


def test_doc_command_check_fails_on_the_old_cluster_example(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Usage, a log line and a shell variable are not checked as they are:\n\n"
        "```bash\n"
        "nanollmserve serve [MODEL] [--port PORT]\n"
        "nanollmserve ready: http://127.0.0.1:8000 model=x\n"
        'FLAGS="--max-num-seqs 8"\n'
        "OMP_NUM_THREADS=1 nice -n 10 nanollmserve serve $FLAGS --kv-cache-memory 2GiB &\n"
        "```\n"
    )
    (tmp_path / "docs" / "distributed.md").write_text(
        "```bash\n"
        "nanollmserve cluster --workers 2 \\\n"
        "    --max-num-seqs 32 --kv-cache-memory 2GiB | tee log\n"
        "nanollmserve cluster --workers 2 --kv-cache-memory 2XB\n"
        "nanollmserve serve --max-num-seqs eight\n"
        "```\n"
    )
    result = _run(str(SCRIPTS / "check_doc_commands.py"), str(tmp_path))
    assert result.returncode == 1
    errors = [line for line in result.stdout.splitlines() if "docs/distributed.md" in line]
    assert len(errors) == 2, result.stdout
    # The flags `cluster` passes on are checked as its workers' `serve` flags.
    assert "docs/distributed.md:4:" in errors[0] and "--kv-cache-memory" in errors[0]
    assert "docs/distributed.md:5:" in errors[1] and "--max-num-seqs" in errors[1]
    assert "2 of 4 command line(s) do not parse" in result.stdout


# -- generated reference pages ----------------------------------------------------------------


def test_reference_pages_match_the_code_and_a_stale_one_fails(tmp_path: Path) -> None:
    result = _run(str(SCRIPTS / "gen_reference.py"), "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    copy = tmp_path / "docs" / "reference"
    shutil.copytree(REPO_ROOT / "docs" / "reference", copy)
    page = copy / "serve-flags.md"
    page.write_text(page.read_text().replace("NANOLLMSERVE_KV_CACHE_MEMORY", "NANOLLMSERVE_X"))
    result = _run(str(SCRIPTS / "gen_reference.py"), "--check", str(tmp_path))
    assert result.returncode == 1
    assert "out of date: serve-flags.md" in result.stdout
    assert "make reference" in result.stdout


def test_reference_pages_list_what_the_code_defines() -> None:
    reference = REPO_ROOT / "docs" / "reference"
    flags = (reference / "serve-flags.md").read_text()
    assert "| `--kv-cache-memory` |" in flags and "`NANOLLMSERVE_KV_CACHE_MEMORY`" in flags
    assert "[`spec-decode`](#bench-spec-decode)" in (reference / "bench.md").read_text()
    metrics = (reference / "metrics.md").read_text()
    assert "`nanollmserve:prompt_tokens_total` | counter" in metrics
    assert "`nanollmserve:spec_decode_num_drafts_total`" in metrics
    assert "| POST | `/v1/chat/completions` | openai |" in (reference / "endpoints.md").read_text()


# -- stale wording about done milestones ------------------------------------------------------

OLD_STALE_TEXTS = {
    "README.md": "streaming, gRPC and Prometheus metrics; a multi-worker router and tensor "
    "parallelism are\nplanned.\n",
    "docs/ARCHITECTURE.md": "decode target) and m17 (quantization) are in progress; m13-m16, "
    "m18 and m19 are planned (see\nthe index).\n",
    "docs/RELIABILITY.md": "| Router failover | the router stops sending to a worker | "
    "`distributed/` | m13 | planned | |\n",
    "docs/observability.md": "them. The router service in front of them is **pending** until "
    "milestone m13 lands; its\nexpected shape is below.\n",
    "docs/design/engine.md": "The same torch code runs on CPU and CUDA; a fused CUDA\nkernel "
    "(FlashAttention-style varlen prefill, a paged decode kernel) is not built yet (m07).\n",
}


@pytest.mark.parametrize("name", sorted(OLD_STALE_TEXTS))
def test_stale_wording_check_catches_the_old_text(name: str) -> None:
    check_docs = _script("check_docs")
    milestones = check_docs.read_milestones([])
    found = check_docs.stale_wording(OLD_STALE_TEXTS[name], milestones)
    assert found, f"the old text of {name} passes the check"


def test_stale_wording_check_leaves_other_uses_alone() -> None:
    check_docs = _script("check_docs")
    milestones = check_docs.read_milestones([])
    fine = (
        "A `RequestStream` holds one pending output; new deltas merge into it (m02).\n\n"
        "Statuses are `planned`, `in progress` and `done`.\n\n"
        "```\nthe router is planned (m13)\n```\n"
    )
    assert check_docs.stale_wording(fine, milestones) == []


# -- a history entry for every commit ---------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    done = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def test_every_commit_since_the_marker_needs_a_history(tmp_path: Path) -> None:
    check_docs = _script("check_docs")
    check_docs.ROOT = tmp_path
    _git(tmp_path, "init", "-q")
    marker = _commit(tmp_path, "before the marker, never checked", {"a.txt": "a"})
    _commit(tmp_path, "feat: with its history", {"b.txt": "b", "histories/2026-12/x.md": "x"})
    _commit(tmp_path, "feat: without one", {"c.txt": "c"})
    typo = _commit(tmp_path, "docs: typo", {"c.txt": "C"})
    assert check_docs.commits_without_history(marker, set()) == [
        f"{_git(tmp_path, 'rev-parse', '--short=7', 'HEAD~1')} feat: without one",
        f"{typo[:7]} docs: typo",
    ]
    assert [c.split(" ", 1)[1] for c in check_docs.commits_without_history(marker, {typo})] == [
        "feat: without one"
    ]
    # A clone without the marker commit (shallow) cannot tell: the check is skipped.
    assert check_docs.commits_without_history("0" * 40, set()) is None
    errors: list[str] = []
    (tmp_path / "histories" / "checked-since").write_text(marker + "\n")
    check_docs.check_commit_histories(errors)
    assert len(errors) == 2 and "has no history entry" in errors[0]


def test_the_marker_is_at_or_before_head() -> None:
    marker = (REPO_ROOT / "histories" / "checked-since").read_text().split()[0]
    if subprocess.run(["git", "cat-file", "-e", f"{marker}^{{commit}}"], cwd=REPO_ROOT).returncode:
        pytest.skip("no git history here (a shallow clone)")
    ancestor = ["git", "merge-base", "--is-ancestor", marker, "HEAD"]
    assert subprocess.run(ancestor, cwd=REPO_ROOT).returncode == 0


# -- benchmark provenance ---------------------------------------------------------------------


def test_bench_json_carries_its_provenance(tmp_path: Path) -> None:
    check_docs = _script("check_docs")
    output = tmp_path / "blocks.json"
    argv = ["bench", "blocks", "--num-requests", "8", "--output", str(output)]
    result = _run("-m", "nanollmserve.cli.main", *argv, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    record = json.loads(output.read_text())
    assert check_docs.bench_provenance_problem(record) is None, record.get("provenance")
    provenance = record["provenance"]
    assert provenance["command"] == "nanollmserve " + " ".join(argv)
    assert provenance["cores"] >= 1 and provenance["date"].endswith("Z")
    # The records committed before provenance existed fail the check.
    old = json.loads((REPO_ROOT / "docs" / "assets" / "bench" / "blocks.json").read_text())
    assert "has no provenance" in check_docs.bench_provenance_problem(old)
    old["provenance"] = {**provenance, "git": "my laptop"}
    assert "must be a revision" in check_docs.bench_provenance_problem(old)
