"""completions.jsonl: the first prompts' completions, rewards and reward columns of a generation, at each log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero.rollout.rewards import RewardContext

COMPLETIONS_FILE = "completions.jsonl"
LOGGED_COMPLETIONS = 4
"""Prompts (with their completions and rewards) written to completions.jsonl at each log point."""


def logged_samples(
    tokenizer: Any,
    data: Any,
    context: RewardContext,
    each: list[int],
    completions: list[list[int]],
    total: torch.Tensor,
    g: int,
) -> list[dict[str, Any]]:
    """The first ``LOGGED_COMPLETIONS`` prompts' completions (of prompt ``each[i]`` of ``data``) for
    completions.jsonl, with the rewards' extra columns (``log_extra``: one value per completion)."""
    extra = {k: v for k, v in context.extra.items() if len(v) == len(completions)}
    texts = tokenizer.batch_decode(completions[: LOGGED_COMPLETIONS * g], skip_special_tokens=True)
    return [
        {"prompt": data.prompt_text(each[i]), "completion": texts[i], "reward": float(total[i])}
        | {column: values[i] for column, values in extra.items()}
        for i in range(len(texts))
    ]


def write_samples(out_dir: Path | None, generation: int, samples: list[dict[str, Any]]) -> None:
    """Append ``samples`` (of generation ``generation``) to ``<out_dir>/completions.jsonl``; rank 0 only."""
    if out_dir is None or not samples or (dist.is_initialized() and dist.get_rank() != 0):
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / COMPLETIONS_FILE).open("a") as fh:
        fh.write(json.dumps({"generation": generation, "samples": samples}) + "\n")
