"""The import rules of docs/ARCHITECTURE.md, checked on the source with `ast`: what each
package may import, the leaves that import nothing of the project, no import circle between
files; and the light imports the CLI relies on: `import nanollmserve` and
`nanollmserve --help` load no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
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
    # The frontend hands token ids to the engine: no web stack, no model code.
    "frontend": [
        "api", "model", "layers", "native", "metrics", "cli", "bench", "llm", "router", "cluster",
    ],
    "metrics": [
        "api", "frontend", "model", "layers", "native", "cli", "bench", "llm", "router", "cluster",
    ],
    # The benchmarks drive the whole stack from the top, under the CLI that parses their flags.
    "bench": ["cli"],
    # The CLI is the top: it wires every layer, and the rules above keep everything else off it.
    "cli": [],
    # The engine's one flat configuration: the CLI, the engine and `LLM` read it; it reads none.
    "config": [
        "api", "frontend", "engine", "model", "layers", "native", "metrics", "cli", "bench", "llm",
        "router", "cluster", "distributed",
    ],
}  # fmt: skip

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

# leaf -> the only other nanollmserve modules it may import: the bottom of the house, so
# nothing a leaf imports can import it back.
LEAVES = {
    # The tensor-parallel group and its collectives, called by layers/ and model/. Running the
    # ranks uses the engine's model runner, so it lives in engine/tensor_parallel/.
    "distributed": [],
    "sizes": [],  # byte sizes (`2GiB`): config.py and cli/ parse them
    "quantization_names": [],  # the `--quantization` names config.py, cli/, model/, layers/ share
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def walk(tree: ast.AST, *, runtime_only: bool) -> Iterator[ast.AST]:
    """`ast.walk`, breadth first; with `runtime_only`, the body of an `if TYPE_CHECKING:` (never
    run) is left out and its `else:` kept."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        if runtime_only and isinstance(node, ast.If) and is_type_checking(node.test):
            todo.extend([node.test, *node.orelse])
        else:
            todo.extend(ast.iter_child_nodes(node))


def imported_modules(
    path: Path, root: Path, *, runtime_only: bool = False
) -> list[tuple[str, int]]:
    """Every module an `import` or `from ... import` names, anywhere in the file (functions
    included; `if TYPE_CHECKING:` blocks too unless `runtime_only`), relative imports resolved;
    `from a import b` counts as importing `a.b` too, since `b` may be a submodule (with
    `runtime_only`, as `a.b` only: the caller finds which of the two is a module)."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in walk(ast.parse(path.read_text(), filename=str(path)), runtime_only=runtime_only):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not runtime_only:
                found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def breaks_rule(layer: str, name: str, top: str) -> bool:
    """Whether `layer` (a package or a top-level module) may not import the module `name`."""
    if not name.startswith(top + "."):
        return False
    target = name.split(".")[1]
    if layer in LEAVES:
        return target != layer and target not in LEAVES[layer]
    return target in FORBIDDEN.get(layer, [])


def violations(root: Path) -> list[str]:
    top = root.name
    problems: dict[str, str] = {}  # one line per import statement
    for path in sorted(root.rglob("*.py")):
        first = path.relative_to(root).parts[0]
        layer = first.removesuffix(".py")
        rel = path.relative_to(root.parent.parent)
        for name, line in imported_modules(path, root):
            if breaks_rule(layer, name, top):
                where = f"{layer}.py" if first.endswith(".py") else f"{layer}/"
                problems.setdefault(f"{rel}:{line}", f"{rel}:{line}: {where} imports {name}")
    return list(problems.values())


def packages_without_a_rule(root: Path) -> list[str]:
    """The packages (folders of src/nanollmserve) that neither FORBIDDEN nor LEAVES names."""
    packages = {p.relative_to(root).parts[0] for p in root.glob("*/**/*.py")}
    return sorted(packages - FORBIDDEN.keys() - LEAVES.keys())


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {module it imports: "file:line"}, from the imports that run (module level or in
    a function; not under `if TYPE_CHECKING:`). An import names its most precise module in the
    tree (`from a import b`: `a.b` when b is a submodule, else `a`); the packages above it that
    Python also initialises are left out, or every module would circle through the top
    package's lazy `__getattr__` and every `from package import submodule` through the
    package's `__init__`."""
    top = root.name
    modules = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for name, line in imported_modules(path, root, runtime_only=True):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name not in (module, top):
                edges.setdefault(name, f"{path.relative_to(root.parent.parent)}:{line}")
    return graph


def import_circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Each circle of the graph as one path that comes back to its start, the edges it takes
    written `a -(file:line)-> b`; one per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = {stack.pop()}
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_circle_through(min(group), group, graph) for group in groups]


def _circle_through(start: str, group: set[str], graph: dict[str, dict[str, str]]) -> list[str]:
    """A shortest path start -> ... -> start inside the group, breadth first."""
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for other in sorted(graph[module]):
            if other in group and other not in came_from:
                came_from[other] = module
                todo.append(other)
        if start in came_from:
            break
    path, module = [start], start
    while True:
        module = came_from[module]
        path.append(module)
        if module == start:
            break
    path.reverse()
    return [f"{a} -({graph[a][b]})-> {b}" for a, b in zip(path, path[1:], strict=False)]


def test_layers_import_only_what_the_architecture_allows() -> None:
    problems = violations(PACKAGE_DIR)
    assert not problems, "import rules of docs/ARCHITECTURE.md broken:\n" + "\n".join(problems)


@pytest.mark.milestone("m28")
def test_every_package_has_an_import_rule() -> None:
    missing = packages_without_a_rule(PACKAGE_DIR)
    assert not missing, f"give {missing} a line in FORBIDDEN or LEAVES (docs/ARCHITECTURE.md)"


@pytest.mark.milestone("m28")
def test_no_import_circle_between_files() -> None:
    circles = import_circles(import_graph(PACKAGE_DIR))
    assert not circles, "import circles (break each, or import under TYPE_CHECKING):\n" + (
        "\n".join("  " + "; ".join(circle) for circle in circles)
    )


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


@pytest.mark.milestone("m28")
def test_the_rule_check_holds_leaves_and_top_level_modules(tmp_path: Path) -> None:
    """A leaf may import only its own package and its listed leaves; a top-level module has a
    rule like a package; a package with no rule is named."""
    root = tmp_path / "src" / "nanollmserve"
    for package in ("distributed", "engine", "newpackage"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "distributed" / "state.py").write_text(
        "import torch\nfrom . import other\nfrom nanollmserve.distributed import x\n"
        "from nanollmserve.errors import UserError\n"
    )
    (root / "config.py").write_text("from nanollmserve.sizes import parse_size\n")
    (root / "sizes.py").write_text("import re\n\n\ndef f():\n    from nanollmserve import cli\n")
    assert violations(root) == [
        "src/nanollmserve/distributed/state.py:4: distributed/ imports nanollmserve.errors",
        "src/nanollmserve/sizes.py:5: sizes.py imports nanollmserve.cli",
    ]
    assert packages_without_a_rule(root) == ["newpackage"]


@pytest.mark.milestone("m28")
def test_the_circle_check_counts_function_imports_but_not_type_checking_ones(
    tmp_path: Path,
) -> None:
    root = tmp_path / "src" / "nanollmserve"
    (root / "engine").mkdir(parents=True)
    (root / "__init__.py").write_text("def __getattr__(name):\n    from nanollmserve import c\n")
    (root / "engine" / "__init__.py").write_text("")
    (root / "a.py").write_text("from nanollmserve.engine import b\n")
    (root / "engine" / "b.py").write_text("import os\n\n\ndef f():\n    from .. import c\n")
    (root / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nimport nanollmserve.a\n\n"
        "if TYPE_CHECKING:\n    from nanollmserve.d import D\n"
    )
    (root / "d.py").write_text("from nanollmserve import c\n")
    assert import_circles(import_graph(root)) == [
        [
            "nanollmserve.a -(src/nanollmserve/a.py:1)-> nanollmserve.engine.b",
            "nanollmserve.engine.b -(src/nanollmserve/engine/b.py:5)-> nanollmserve.c",
            "nanollmserve.c -(src/nanollmserve/c.py:3)-> nanollmserve.a",
        ]
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
