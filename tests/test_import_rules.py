"""The import rules of docs/ARCHITECTURE.md, checked on the source with `ast`, and the light
imports the CLI relies on: `import nanollmserve` and `nanollmserve --help` load no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.milestone("m00")

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "src" / "nanollmserve"

# layer -> the nanollmserve modules it must never import (docs/ARCHITECTURE.md, "Import rules"
# and the "knows about" column of the layer table). A name covers its submodules.
FORBIDDEN = {
    # The engine is usable offline with no web stack; metrics read the engine, not the reverse.
    "engine": ["api", "frontend", "metrics", "cli", "bench", "llm"],
    # A model is a function of (input_ids, positions): it knows torch, not the serving stack.
    "model": ["engine", "api", "frontend", "metrics", "cli", "bench", "llm", "config"],
    "layers": ["engine", "api", "frontend", "metrics", "cli", "bench", "llm", "config"],
    # The API talks to the frontend's AsyncEngine only: no model code, no engine internals.
    "api": ["model", "layers", "engine", "cli", "bench", "llm"],
    # The router is a small HTTP process: no engine, no torch (api/ and metrics/ load them).
    "router": ["api", "frontend", "engine", "model", "layers", "metrics", "cli", "bench", "llm"],
    "cluster": ["api", "frontend", "engine", "model", "layers", "metrics", "cli", "bench", "llm"],
    # Request tracing is shared by the API and the router, so it is held to the router's rule.
    "tracing": ["api", "frontend", "engine", "model", "layers", "metrics", "cli", "bench", "llm"],
}

# The native kernels are the bottom of the house: `native/` imports no other project module
# but the private cache its build uses (and the errors that raises). Computed, so a package
# added later is covered too.
NATIVE_MAY_IMPORT = ("native", "private_cache", "errors")
FORBIDDEN["native"] = sorted(
    path.stem
    for path in PACKAGE_DIR.iterdir()
    if (path.suffix == ".py" or (path / "__init__.py").is_file())
    and path.stem not in ("__init__", *NATIVE_MAY_IMPORT)
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> list[tuple[str, int]]:
    """Every module an `import` or `from ... import` names, anywhere in the file (functions and
    `if TYPE_CHECKING:` blocks included), relative imports resolved; `from a import b` counts
    as importing `a.b` too, since `b` may be a submodule."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def violations(root: Path) -> list[str]:
    top = root.name
    problems: dict[str, str] = {}  # one line per import statement
    for path in sorted(root.rglob("*.py")):
        layer = path.relative_to(root).parts[0]
        if layer not in FORBIDDEN:
            continue
        rel = path.relative_to(root.parent.parent)
        for name, line in imported_modules(path, root):
            for banned in FORBIDDEN[layer]:
                target = f"{top}.{banned}"
                if name == target or name.startswith(target + "."):
                    problems.setdefault(f"{rel}:{line}", f"{rel}:{line}: {layer}/ imports {name}")
    return list(problems.values())


def test_layers_import_only_what_the_architecture_allows() -> None:
    problems = violations(PACKAGE_DIR)
    assert not problems, "import rules of docs/ARCHITECTURE.md broken:\n" + "\n".join(problems)


def test_the_rule_check_finds_a_planted_violation(tmp_path: Path) -> None:
    """The checker itself: an import inside a function and a relative one are both caught."""
    root = tmp_path / "src" / "nanollmserve"
    (root / "engine").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "engine" / "core.py").write_text(
        "import os\n\n\ndef f():\n    from nanollmserve.api import app\n"
    )
    (root / "model" / "llama.py").write_text("from ..engine import scheduler\nfrom . import x\n")
    assert violations(root) == [
        "src/nanollmserve/engine/core.py:5: engine/ imports nanollmserve.api",
        "src/nanollmserve/model/llama.py:1: model/ imports nanollmserve.engine",
    ]


def torch_loaded_by(code: str) -> bool:
    """Run `code` in a fresh interpreter; True if torch ended up imported."""
    probe = code + "\nimport sys\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] == "TORCH"


def test_import_nanollmserve_does_not_load_torch() -> None:
    assert not torch_loaded_by("import nanollmserve")
    assert torch_loaded_by("import nanollmserve.layers.norm")  # the probe can see torch


@pytest.mark.parametrize("argv", [[], ["info"], ["generate"], ["bench"], ["serve"], ["profile"]])
def test_cli_help_does_not_load_torch(argv: list[str]) -> None:
    code = (
        "from nanollmserve.cli.main import main\n"
        "try:\n"
        f"    main({[*argv, '--help']!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
    )
    assert not torch_loaded_by(code)
