"""Where a benchmark result comes from: the `provenance` record every `nanollmserve bench`
JSON carries, so a number in the docs can be traced to its run.

    {"git": "28021b6-dirty", "date": "2026-12-04T05:10:00Z", "cpu_model": "AMD EPYC ...",
     "cores": 2, "command": "nanollmserve bench latency --input-len 32"}

`git` is the short revision of the checkout the package runs from, with `-dirty` when the
tree has uncommitted changes (null outside a git checkout). scripts/check_docs.py requires
these keys in the benchmark JSON files under docs/.
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

PROVENANCE_KEYS = ("git", "date", "cpu_model", "cores", "command")


def git_revision(directory: Path | None = None) -> str | None:
    """`abc1234`, `abc1234-dirty` with uncommitted changes, None outside a checkout."""
    directory = directory or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "--short", "HEAD")
    if revision is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return f"{revision}-dirty" if status else revision


def cpu_model() -> str | None:
    """The CPU's model name, as `lscpu` prints it (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def provenance(argv: list[str] | None = None) -> dict:
    """The provenance record of a run started with `argv` (default: this process's)."""
    argv = sys.argv[1:] if argv is None else argv
    return {
        "git": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "command": shlex.join(["nanollmserve", *argv]),
    }
