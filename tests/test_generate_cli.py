"""`nanollmserve generate` as a user runs it: a subprocess on the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.milestone("m01")


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "generate", "--dtype", "float32", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_chat_prompt_prints_the_answer_and_stats():
    proc = generate("--prompt", "What is the capital of France?", "--chat", "--show-stats")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    stats = dict(line.split(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    for key in ("prompt_tokens", "generated_tokens", "elapsed_s", "ttft_s", "tpot_s",
                "tokens_per_s", "device", "dtype"):  # fmt: skip
        assert key in stats, proc.stderr
    assert stats["device"] == "cpu" and stats["dtype"] == "float32"
    assert int(stats["generated_tokens"]) >= 1


def test_json_output_with_a_seed_is_reproducible():
    args = ("--prompt", "Once upon a time", "--temperature", "1.0", "--seed", "3",
            "--max-tokens", "12", "--ignore-eos", "--json")  # fmt: skip
    first, second = generate(*args), generate(*args)
    assert first.returncode == 0, first.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["text"] == b["text"] and a["generated_tokens"] == 12
    assert a["finish_reason"] == "length"


def test_bad_values_are_one_line_errors():
    proc = generate("--prompt", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("nanollmserve: error: temperature")
    assert "Traceback" not in proc.stderr
