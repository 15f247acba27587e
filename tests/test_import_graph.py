"""No import circle inside a package: the module-level imports of each package's modules form a graph with no
cycle (issue 35 item 7; there was a 6-module circle in rl-cli). A circle works only by import order, and breaks
the day someone imports the other module first.

Counted: ``import x`` and ``from x import y`` at module level, in ``try`` / ``if`` blocks too, less the ones
under ``if TYPE_CHECKING:`` (never run); ``from pkg import name`` counts both ``pkg`` and ``pkg.name`` (a
submodule). Function-local imports are how a module reaches a heavy or optional one lazily; they run after
every module has loaded and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("*/src"))


def _module_level_imports(tree: ast.Module) -> set[str]:
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If):
                test = node.test
                if not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return out


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module name -> the package's own modules it imports at module level."""
    files = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return {name: {m for m in _module_level_imports(ast.parse(f.read_text())) if m in files and m != name}
            for name, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def walk(u: str, path: list[str]) -> None:
        state[u] = "open"
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                walk(v, path)
        path.pop()
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            walk(u, [])
    return found


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.x\ntry:\n    import p.y\n"
                     "except ImportError:\n    pass\ndef f():\n    import p.z\n")
    assert _module_level_imports(tree) == {"typing", "typing.TYPE_CHECKING", "p.y"}


@pytest.mark.parametrize("src", PACKAGES, ids=lambda p: p.parent.name)
def test_no_import_circle_inside_a_package(src):
    graph = import_graph(src)
    assert len(graph) > 3, f"{src}: no modules found"
    found = cycles(graph)
    assert not found, f"{src.parent.name}: import circles (module-level imports): " + "; ".join(
        " -> ".join(c) for c in found)
