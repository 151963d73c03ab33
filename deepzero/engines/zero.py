"""ZeRO data parallel: every rank runs the whole model on its own micro-batches; DeepSpeed partitions the optimizer
state (ZeRO-1), gradients (ZeRO-2) and parameters (ZeRO-3), optionally offloaded to CPU RAM.

LoRA is a model transform applied here, between building the model and ``deepspeed.initialize``, plus an export
variant that merges the adapters (``deepzero.lora``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from deepzero import modeling
from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, DeepSpeedBacked, ModelFactory, draw, lm_loss, loss_normalizer, mean_eval_loss
from deepzero.export import ExportReport, export_hf
from deepzero.lora import LoraSpec, apply_lora, export_lora_hf

Exporter = Callable[[Any, Any, Path, Batch], "ExportReport | None"]


class ZeroEngine(DeepSpeedBacked):
    """A DeepSpeed engine over the whole model."""

    def __init__(
        self,
        engine: Any,
        model: nn.Module,
        exporter: Exporter,
        keep_alive: object | None = None,
        partitioned_at_load: bool = False,
    ) -> None:
        self.engine = engine
        self.model = model
        self.device = torch.device(get_accelerator().current_device_name())
        self.dp_rank = dist.get_rank()
        self.dp_size = dist.get_world_size()
        self._exporter = exporter
        self._keep_alive = keep_alive  # ZeRO-3: HfDeepSpeedConfig must live as long as the engine
        self.partitioned_at_load = partitioned_at_load
        """ZeRO-3 split the parameters while the model was built: no rank ever held the whole model."""

    @classmethod
    def build(
        cls,
        build_model: ModelFactory,
        ds_config: dict[str, Any],
        gradient_checkpointing: bool = False,
        lora: LoraSpec | None = None,
    ) -> ZeroEngine:
        """Instantiate the model (partitioned at load under ZeRO-3), apply LoRA, wrap it in a DeepSpeed engine."""
        stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        keep_alive = modeling.zero3_context(ds_config) if stage == 3 else None
        model = build_model()
        partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
        if gradient_checkpointing and not model.is_gradient_checkpointing:  # (the offloaded kind is set already)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:  # after the build (ZeRO-3: already partitioned), before initialize
            model = apply_lora(model, lora)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
        return cls(engine, model, export_lora_hf if lora is not None else export_hf, keep_alive, partitioned)

    def describe(self) -> str:
        return "  partitioned at load" if self.partitioned_at_load else ""

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        engine = self.engine
        micro = draw(batches, engine.gradient_accumulation_steps())
        normalizer = loss_normalizer(micro, self.dp_size)
        total = torch.zeros((), device=self.device)
        for batch in micro:
            loss = lm_loss(engine, batch, normalizer)
            engine.backward(loss)  # divides by the accumulation steps; ranks' gradients are averaged
            engine.step()
            total += loss.detach().float()
        return total / len(micro)

    def eval_loss(self, batches: Iterator[Batch], micro_batches: int) -> float:
        return mean_eval_loss(self.engine, batches)

    def export(self, tokenizer: Any, out_dir: Path, probe: Batch) -> ExportReport | None:
        return self._exporter(self.engine, tokenizer, out_dir, probe)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(local_values(p)).all()) for p in self.engine.module.parameters())


def local_values(param: torch.Tensor) -> torch.Tensor:
    """The values this rank holds: the whole tensor, or under ZeRO-3 its partition without the padding at the
    end of the last one (DeepSpeed allocates that with torch.empty, so it holds whatever the memory held)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
    return part.narrow(0, 0, max(0, min(part.numel(), param.ds_numel - start)))  # numel 0: swapped out to NVMe


@dataclass(frozen=True)
class ZeroSettings:
    """ZeRO data parallel over all ranks, optionally with activation checkpointing and LoRA adapters."""

    gradient_checkpointing: bool = False
    lora: LoraSpec | None = None

    def dp_size(self, world: int) -> int:
        return world

    def check_batch(self, batch: BatchMath) -> None:
        return None

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> ZeroEngine:
        return ZeroEngine.build(build_model, ds_config, self.gradient_checkpointing, self.lora)
