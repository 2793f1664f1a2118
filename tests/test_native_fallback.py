"""Without a C compiler (m29, issue 42: the prerequisites section of getting-started.md), the
CLI still answers with the bundled model: it says why the native kernels are unavailable and
runs the dequantized weights instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.milestone("m29"), pytest.mark.timeout(300)]


def test_without_a_compiler_generate_answers_on_the_dequantized_weights(tmp_path) -> None:
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanollmserve.cli.main",
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "native GGUF kernels unavailable: no C compiler" in result.stderr
    assert "running the dequantized weights" in result.stderr
    assert "Paris" in result.stdout
