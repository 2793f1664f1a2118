"""What the integration tests need from outside .venv (not a test module): `apt_binary(name)`,
the path of a program from Debian's packages, and `python_module(name)`, an installed package.
`scripts/setup-integration` (run by `make test-integration`) installs them; tests never do.

A missing one skips the calling test, saying how to install it, except in CI (the `CI`
environment variable set, non-empty), where it fails it: CI must not pass having run nothing.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

INSTALL_HINT = "run scripts/setup-integration (as root) to install it"


def apt_binary(name: str) -> str:
    for path in (shutil.which(name), f"/usr/bin/{name}"):
        if path and os.path.exists(path):
            return path
    missing_prerequisite(f"the {name} program is not installed; {INSTALL_HINT}")


def python_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing_prerequisite(f"the {name} Python package is not installed; {INSTALL_HINT}")


def missing_prerequisite(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)
