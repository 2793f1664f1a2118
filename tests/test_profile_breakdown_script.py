"""scripts/profile_breakdown.py runs as documented: the breakdown table of docs/benchmarks.md
comes from it, and it had stopped running when the output processor's `add_request` took an
admitted request (stop 50). Run on the bundled GGUF file given with `--model`, at two batch
sizes for two steps: every part of a step is reported, and the native step's own parts add up
to no more than the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanollmserve.model.source import bundled_gguf_path

pytestmark = [pytest.mark.milestone("m31"), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]


def test_the_breakdown_runs_on_a_given_model_and_accounts_for_each_step():
    command = [
        sys.executable, str(ROOT / "scripts" / "profile_breakdown.py"),
        "--model", str(bundled_gguf_path()), "--batch", "1,3", "--steps", "2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert [row["batch"] for row in report["offline"]] == [1, 3]
    for row in report["offline"]:
        assert row["step_ms"] > 0
        native = row["ms_per_step"]["native decode step (forward + logits in one call)"]
        assert 0 < native <= row["step_ms"]
        assert {"gate_up", "down", "attention", "lm_head"} <= set(row["native_step_ms"])
        assert sum(row["native_step_ms"].values()) <= native * 1.05
    assert "--model" in report["provenance"]["command"]
