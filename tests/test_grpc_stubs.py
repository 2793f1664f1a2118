"""The committed gRPC stubs are what `scripts/gen-proto` makes from proto/nanollmserve.proto
today (CI fails when the proto changed and the stubs were not regenerated)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.milestone("m11")

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "src/nanollmserve/api/grpc_gen"


def test_stubs_are_current():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev extra) is needed")

    generated_with = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'", (STUBS / "nanollmserve_pb2_grpc.py").read_text()
    ).group(1)
    installed = version("grpcio-tools")
    assert installed == generated_with, (
        f"the stubs were generated with grpcio-tools {generated_with} but {installed} is "
        "installed; install the pinned version (pyproject.toml) or regenerate with "
        "scripts/gen-proto and update the pin"
    )
    result = subprocess.run(
        [str(ROOT / "scripts/gen-proto"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_service_has_the_four_rpcs():
    from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    methods = {m.name: m.server_streaming for m in service.methods}
    assert methods == {
        "Generate": False,
        "GenerateStream": True,
        "BatchGenerate": False,
        "Health": False,
    }
