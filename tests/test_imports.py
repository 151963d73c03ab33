"""Imports point one way (issue 31): no module of deepzero imports, directly or through others, a module that
imports it back — at the top or inside a function — and the planner is a package whose only module a training
start needs is its fit check."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO
from helpers.import_graph import cycles, import_graph


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
