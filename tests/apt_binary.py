"""`apt_binary(package, name)`: the path of a program the integration tests need, installed
from Debian's packages with apt-get when it is missing (not a test module). Where that is
impossible (no apt-get, not root, the install fails) the calling test is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def apt_binary(package: str, name: str) -> str:
    found = _find(name)
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip(f"{name} is not installed and apt-get is not available to install it")
    if os.geteuid() != 0:
        pytest.skip(f"{name} is not installed; installing it with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"apt-get could not install {package}: {result.stderr[-500:]}")
    found = _find(name)
    if found is None:
        pytest.skip(f"apt-get installed {package} but there is no {name} binary")
    return found


def _find(name: str) -> str | None:
    for path in (shutil.which(name), f"/usr/bin/{name}"):
        if path and os.path.exists(path):
            return path
    return None
