"""Command outputs shown in docs/ are the commands' outputs now (bench/doc_outputs.py regenerates them)."""

from __future__ import annotations

import re

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


GRPO_DOC = REPO / "docs" / "grpo.md"
GRPO_CMD = "python -m deepzero.plan --model deepseek-r1-distill-qwen-{size} --grpo"
"""The planner command whose figures docs/grpo.md quotes in prose and in its condensed table (3 × 24 GiB, G 8,
prompts of 512 tokens, micro-batch 1: the command's defaults)."""


def _grpo_cells(size: str) -> dict[tuple[str, str], list[str]]:
    """The --grpo table of ``size`` as (preset, ckpt) -> the leading figure of each later column (full, LoRA,
    QLoRA, LoRA rows per call), as the command prints it."""
    out = doc_outputs.run(GRPO_CMD.format(size=size))
    table = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 6 and cells[1] in ("on", "off"):
            table[cells[0], cells[1]] = [cell.split()[0] for cell in cells[2:]]
    return table


def test_grpo_doc_figures_are_the_planners() -> None:
    """docs/grpo.md's rows per generate call (zero2_bf16 + checkpointing, LoRA r16) and every cell of its longest
    completion table are what the planner prints now."""
    small, large = _grpo_cells("1.5b"), _grpo_cells("7b")
    text = GRPO_DOC.read_text()
    said = re.search(r"The planner fits\s+([\d,]+) rows per call for R1-Distill-Qwen-1\.5B and\s+([\d,]+) for 7B", text)
    assert said, f"{GRPO_DOC}: the rows-per-call sentence is gone; keep it or drop this test"
    planned = (small["zero2_bf16", "on"][3], large["zero2_bf16", "on"][3])
    assert said.groups() == planned, f"{GRPO_DOC}: rows per call {said.groups()}, the planner prints {planned}"
    rows = re.findall(r"^\| (\w+) \| (on|off) \| (.+) \|$", text, re.M)
    assert len(rows) == 6, f"{GRPO_DOC}: expected the 6-row longest-completion table, found {len(rows)} rows"
    for preset, ckpt, rest in rows:
        doc = [cell.strip() for cell in rest.split("|")]
        want = small[preset, ckpt][:3] + large[preset, ckpt][:3]
        assert doc == want, f"{GRPO_DOC}: {preset} ckpt {ckpt} shows {doc}, the planner prints {want}"
