"""Run `nanollmserve bench ...` as a subprocess and return the JSON it prints (test helper)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_bench(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
