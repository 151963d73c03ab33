"""deepzero's import graph, read from the source: every import, at the top of a module or inside a function (the
walker of tests/test_imports.py, which fails on circles, and tests/test_layout.py, which fails on imports that run up
the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "deepzero"


def module_paths() -> dict[str, Path]:
    """Each deepzero module by its dotted name (a package by its own name: ``deepzero.plan``)."""
    return {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


def import_graph() -> dict[str, set[str]]:
    """deepzero's modules and the deepzero modules each imports anywhere in its source (``from X import name``
    counts as importing ``X.name`` when that is a module)."""
    modules = module_paths()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
