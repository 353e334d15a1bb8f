"""The package layout holds: each package imports only the layers below it (docs/architecture.md),
nothing but cli knows the terminal, and no module grows past what one reader takes in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "localinfer"
# Lowest first. A module may import its own package and any package before it; `backends` is the
# engine boundary (installed as localinfer.backends from ROOT/backends).
LAYERS = ["errors", "units", "settings", "machine", "gguf", "media", "user_config", "models",
          "backends", "thinking", "quant", "engine", "cache", "speculate", "fit", "pipeline", "routing", "api", "measure", "server", "cli"]
TERMINAL = ("typer", "rich", "click")
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    for path in (ROOT / "backends").rglob("*.py"):     # one subpackage per engine
        parts = ("backends", *path.relative_to(ROOT / "backends").with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _layer(dotted: str) -> str:
    top = dotted.split(".")[0]
    return top if top in LAYERS else "__main__" if top == "__main__" else "root"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every import in the file, at any depth (lazy imports count too), as (line, module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "localinfer":
                names += [(node.lineno, f"localinfer.{a.name}") for a in node.names]
            else:
                names.append((node.lineno, node.module))
    return names


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_lower_layers(module):
    own = _layer(module)
    if own in ("root", "__main__"):
        return
    allowed = LAYERS[:LAYERS.index(own) + 1]
    for line, name in _imports(MODULES[module]):
        if name.startswith("localinfer."):
            target = _layer(name.removeprefix("localinfer."))
            assert target in allowed, f"{module}:{line} imports {name}, a layer above {own}"
        elif own != "cli":
            assert name.split(".")[0] not in TERMINAL, f"{module}:{line} imports {name}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by concern"


def test_every_module_is_in_a_known_place():
    """A new top-level module must be placed in the layer order above, not left beside the rest."""
    top = {name.split(".")[0] for name in MODULES}
    assert top <= set(LAYERS) | {"__init__", "__main__"}, sorted(top - set(LAYERS))


# Edges of the import graph allowed to close a cycle: a package loading its own parts on first use
# (never at import time, which `test_allowed_cycle_edges_are_lazy` checks). The parts import the
# package's shared types (`Backend`, `LoadOptions`, `Session`) from it, so the way back is needed.
ALLOWED_CYCLE_EDGES = {
    # The registry loads each engine's record or session only when asked which are installed or
    # to load a model, so `import localinfer.backends` loads no engine.
    ("backends", "backends.llama"),
    ("backends", "backends.mlx.session"),
    ("backends", "backends.onnx.session"),
    # llama.cpp's record loads its session (numpy, the bindings) only to load a model, and its
    # SequenceBatch only for map and serve.
    ("backends.llama", "backends.llama.session"),
    ("backends.llama", "backends.llama.batched"),
    ("backends.llama", "backends.llama.embed"),
}


def _resolve(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The localinfer modules an import statement names: `from localinfer.x import y` is module
    x.y when y is one, else x; names the root package defines resolve to it (`__init__`)."""
    if isinstance(node, ast.Import):
        dotted = [a.name for a in node.names if a.name.split(".")[0] == "localinfer"]
        return {name.removeprefix("localinfer").lstrip(".") or "__init__" for name in dotted}
    if node.level or not node.module or node.module.split(".")[0] != "localinfer":
        return set()
    base = node.module.removeprefix("localinfer").lstrip(".")
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        found.add(sub if sub in MODULES else base or "__init__")
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _local_imports(path: Path, *, at_import_time: bool = False) -> set[str]:
    """The localinfer modules this file imports, at any depth (imports inside functions count);
    with at_import_time, only those that run when the module is imported (not in a function, a
    lambda or an `if TYPE_CHECKING:` block)."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _resolve(node)
        deferred = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        if at_import_time and (isinstance(node, deferred) or _is_type_checking(node)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found & set(MODULES)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for dep in sorted(graph[name]):
            if dep not in index:
                visit(dep)
                low[name] = min(low[name], low[dep])
            elif dep in stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            component = stack[stack.index(name):]
            del stack[stack.index(name):]
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycles():
    """No two modules import each other, directly or around a loop, even lazily: a cycle hidden in
    a function still ties the modules together (and breaks when the import moves to the top)."""
    graph = {name: _local_imports(path) - {name} for name, path in MODULES.items()}
    for source, target in ALLOWED_CYCLE_EDGES:
        graph[source].discard(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (move the shared piece down to a module both use): " + \
        "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("edge", sorted(ALLOWED_CYCLE_EDGES))
def test_allowed_cycle_edges_are_lazy(edge):
    """Each allowed edge exists (the list stays minimal) and is an import inside a function."""
    source, target = edge
    assert target in _local_imports(MODULES[source]), f"{source} no longer imports {target}"
    assert target not in _local_imports(MODULES[source], at_import_time=True), \
        f"{source} imports {target} when it is imported: a real cycle"


def test_cycle_finder():
    """The finder itself: a loop is found, a module that only leads into it is not part of it."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
