"""Imports point one way (issue 31): no module of deepzero imports, directly or through others, a module that
imports it back — at the top or inside a function — and the planner is a package whose only module a training
start needs is its fit check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO
from helpers.import_graph import import_graph


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


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_the_walker_finds_a_circle_hidden_inside_a_function() -> None:
    edges = import_graph()
    edges["deepzero.errors"] = {*edges["deepzero.errors"], "deepzero.run"}  # as if errors imported run lazily
    assert any("deepzero.errors" in c and "deepzero.run" in c for c in cycles(edges))


@pytest.mark.parametrize("module", ["deepzero.run", "deepzero.trainer"])
def test_a_training_start_imports_the_fit_check_not_the_tables_or_the_cli(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('deepzero.plan')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    assert "deepzero.plan.fit" in loaded
    assert not loaded & {"deepzero.plan.tables", "deepzero.plan.cli", "deepzero.plan.__main__"}, loaded
