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
LAYERS = ["errors", "units", "settings", "gguf", "user_config", "models", "backends", "quant",
          "engine", "cache", "speculate", "fit", "pipeline", "api", "measure", "server", "cli"]
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


def _top_level_imports(path: Path) -> set[str]:
    """localinfer modules imported when this one is (not those imported inside functions or only
    for type checking)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        blocks = node.body + node.handlers if isinstance(node, ast.Try) else [node]
        for stmt in blocks:
            stmts = stmt.body if isinstance(stmt, ast.ExceptHandler) else [stmt]
            for s in stmts:
                if isinstance(s, ast.ImportFrom) and s.module and s.module.startswith("localinfer"):
                    base = s.module.removeprefix("localinfer").lstrip(".")
                    for alias in s.names:   # `from localinfer.x import y`: y may be a module
                        sub = f"{base}.{alias.name}" if base else alias.name
                        found.add(sub if sub in MODULES else base)
    return found - {""}


def test_no_import_cycles():
    graph = {name: _top_level_imports(path) & set(MODULES) for name, path in MODULES.items()}
    state: dict[str, int] = {}      # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [name, dep])
            if dep not in state:
                visit(dep, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
