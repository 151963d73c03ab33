"""Command outputs shown in docs/ are the commands' outputs now (bench/doc_outputs.py regenerates them)."""

from __future__ import annotations

import pytest
from conftest import REPO

from bench import doc_outputs

MARKED = [
    (doc, match["cmd"], match["body"])
    for doc in sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
    for match in doc_outputs.blocks(doc)
]


def test_docs_mark_the_planner_outputs_they_show() -> None:
    assert any(doc.name == "memory.md" and "--model deepseek-coder-1.3b" in cmd for doc, cmd, _ in MARKED)


@pytest.mark.parametrize("doc, cmd, body", MARKED, ids=[f"{d.name}: {c[:60]}" for d, c, _ in MARKED])
def test_a_shown_output_is_what_the_command_prints(doc: object, cmd: str, body: str) -> None:
    assert body == doc_outputs.run(cmd), f"{doc}: stale output of `{cmd}`; run python -m bench.doc_outputs"
