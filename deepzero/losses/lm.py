"""The causal-LM loss over target tokens, weighted so the step's gradient is that of the global token mean: the
normalizer every engine and objective divides by (Transformers' ``num_items_in_batch``) and one micro-batch's loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepzero.data import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


def target_count(batches: list[Batch]) -> torch.Tensor:
    """Target tokens (labels not ignored) in ``batches``, a float on their device."""
    return sum((b["labels"] != IGNORE_INDEX).sum().float() for b in batches)


def loss_normalizer(micro: list[Batch], dp_size: int, group: Any = None) -> torch.Tensor:
    """What each micro-batch's summed cross-entropy is divided by, so that the step's gradient is that of the mean
    over every target token of the global batch, however it is cut into micro-batches, accumulation steps and ranks.

    The engines average gradients over ``len(micro)`` accumulation steps and ``dp_size`` ranks, so each micro-batch
    loss is ``sum · len(micro) · dp_size / N`` with N the global target count (one all-reduce per step, on the
    device). Transformers' loss takes it as ``num_items_in_batch`` (``reduction="sum"`` divided by it). A step with
    no target at all gives 0 loss and zero gradients.
    """
    total = target_count(micro)
    if dist.is_initialized() and dp_size > 1:
        dist.all_reduce(total, group=group)
    return total.clamp(min=1) / (len(micro) * dp_size)


def lm_loss(model: Any, batch: Batch, normalizer: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss ``sum of cross-entropy / normalizer`` of one micro-batch.

    ``use_cache=False``: with a cache Transformers ignores ``position_ids`` when it builds the mask, so packed
    documents would attend to each other; without one it builds a block-diagonal causal mask from them.
    """
    return model(**batch, num_items_in_batch=normalizer, use_cache=False).loss
