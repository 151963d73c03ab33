"""The one interface the training loop sees, whatever way the cards are used (ZeRO, pipeline, layer split)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from deepzero.hf_export import ExportReport
from deepzero.losses.objectives import LanguageModeling, Objective

ModelFactory = Callable[[], nn.Module]
"""Builds the model when the engine is ready for it (ZeRO-3 first sets up partitioning at load)."""

Batch = dict[str, torch.Tensor]
"""One micro-batch from the packed dataset: ``input_ids``, ``labels``, ``shift_labels``."""


class TrainEngine(Protocol):
    """A model wrapped for training on the cards, built from the model and the resolved DeepSpeed config.

    The loop never asks which kind it has: it steps, evaluates, saves, loads, exports and reads the numbers below.
    """

    objective: Objective
    """What it minimises: the LM loss, or a preference loss (``deepzero.losses.objectives``)."""
    model: nn.Module
    """The whole Hugging Face model (config, parameter counts, FLOPs); a pipeline's ranks train only their stages."""
    device: torch.device
    """Where this rank's micro-batches go."""
    dp_rank: int
    dp_size: int
    """This rank's data-parallel position: the sampler gives each data-parallel rank its own micro-batches."""

    def describe(self) -> str:
        """How the cards are used, for the run header: "", "  pipeline 3 stages × data-parallel 1", ..."""
        ...

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches from ``batches``, its gradient that of
        the objective's mean over the global batch (target tokens: ``loss_normalizer``; pairs); this rank's share of
        that mean × data-parallel size (so the mean over ranks is the global mean), left on ``device``."""
        ...

    def eval_loss(self, batches: Iterator[Batch], micro_batches: int) -> float:
        """Mean loss (token-weighted; pair-weighted for a preference loss) over ``micro_batches`` micro-batches per
        data-parallel rank, the same on every rank (a collective: every rank calls it)."""
        ...

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool = False) -> None:
        """DeepSpeed's checkpoint call: weights, optimizer, LR schedule and ``client_state`` under ``save_dir/tag``."""
        ...

    def load_checkpoint(
        self, load_dir: str, tag: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> tuple[str | None, dict[str, Any]]:
        """DeepSpeed's load call: ``(path or None when nothing was found, client_state)``."""
        ...

    def export(self, tokenizer: Any, out_dir: Path, probe: Batch) -> ExportReport | None:
        """Write a Hugging Face folder (rank 0), reload it and compare logits on ``probe``; every rank calls it.
        Rank 0 gets the report, the others None."""
        ...

    def synchronize(self) -> None:
        """Wait for this rank's devices (only at log, eval and save points)."""
        ...

    def weights_finite(self) -> bool:
        """Whether the weights this rank holds (its ZeRO-3 partitions, its pipeline stages) are all finite."""
        ...

    def lr(self) -> float: ...

    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (None before the first step or without clipping)."""
        ...

    def skipped_steps(self) -> int:
        """Optimizer steps skipped by fp16 loss scaling so far."""
        ...

    def loss_scale(self) -> float | None:
        """fp16's current dynamic loss scale; None in bf16/fp32."""
        ...


class DeepSpeedBacked:
    """What every DeepSpeed engine (ZeRO or pipeline) answers the same way; ``self.engine`` is DeepSpeed's."""

    engine: Any

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool = False) -> None:
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)

    def load_checkpoint(
        self, load_dir: str, tag: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> tuple[str | None, dict[str, Any]]:
        return self.engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
        )

    def synchronize(self) -> None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        return as_float(self.engine.get_global_grad_norm())

    def skipped_steps(self) -> int:
        return int(self.engine.skipped_steps)

    def loss_scale(self) -> float | None:
        if not self.engine.fp16_enabled():
            return None
        optimizer = self.engine.optimizer
        return float(getattr(optimizer, "loss_scale", getattr(optimizer, "cur_scale", 0)))


def draw(batches: Iterator[Batch], count: int) -> list[Batch]:
    """The next ``count`` micro-batches: a step's whole share is drawn first, to count its targets."""
    return [next(batches) for _ in range(count)]


@torch.no_grad()
def mean_eval_loss(engine: Any, batches: Iterator[Batch], objective: Objective | None = None) -> float:
    """Mean loss over ``batches`` in eval mode, over every rank: the objective's summed loss / its count (target
    tokens for the LM loss, pairs for a preference loss)."""
    objective = objective or LanguageModeling()
    engine.eval()
    total = torch.zeros(2, device=engine.device)
    for batch in batches:
        loss_sum, count = objective.eval_sums(engine, batch)
        total[0] += loss_sum.float().to(total.device)
        total[1] += count.float().to(total.device)
    engine.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def to_device(batches: Iterator[Batch], device: torch.device | str) -> Iterator[Batch]:
    """Move each micro-batch to ``device`` as it is drawn (asynchronously from pinned memory)."""
    for batch in batches:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def as_float(value: Any) -> float | None:
    """A DeepSpeed number (tensor, float or None) as a float or None."""
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)
