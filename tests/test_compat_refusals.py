"""Feature pairs that are refused with one clear error (compatibility matrix,
scripts/compat_matrix.py), checked through the public interfaces: the offline `LLM` API and
the CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanollmserve import EngineConfig
from nanollmserve.errors import UserError

pytestmark = pytest.mark.milestone("m00")


def test_lora_on_int8_weights_is_refused(compat):
    message = "LoRA adapters with --quantization int8 are not supported"
    with pytest.raises(UserError, match=message) as error:
        EngineConfig(enable_lora=True, quantization="int8")
    compat.refused("int8", "lora", str(error.value))


def test_the_router_has_no_grpc_port(compat):
    proc = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "router", "--worker",
         "http://127.0.0.1:1", "--grpc-port", "50051"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unrecognized arguments: --grpc-port" in proc.stderr
    compat.refused("grpc", "router", proc.stderr)
