"""The ways to use the cards, behind one interface (``TrainEngine``).

Each way is a settings object chosen once, while the run is planned (:func:`choose`), that knows its data-parallel
size, checks the batch math it needs, and builds its engine:

- :class:`ZeroSettings` → ``zero.ZeroEngine``: DeepSpeed ZeRO-0/1/2/3 data parallel (LoRA is a model transform here);
- ``pipeline.PipelineSettings`` → ``pipeline.PipelineEngine``: DeepSpeed's PipelineModule, one stage per rank group;
- :class:`LayerSplitSettings` → ``layer_split.LayerSplitEngine``: one process, layers balanced over the cards.

A new way plugs in as one module with an engine class implementing ``TrainEngine`` and a settings class with
``dp_size``, ``check_batch`` and ``build``, selected in :func:`choose`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, TrainEngine
from deepzero.engines.layer_split import LayerSplitEngine, parse_devices
from deepzero.engines.pipeline import PipelineSettings
from deepzero.engines.zero import ZeroEngine
from deepzero.errors import UserError
from deepzero.lora import LoraSpec

ModelFactory = Callable[[], nn.Module]
"""Builds the model when the engine is ready for it (ZeRO-3 first sets up partitioning at load)."""


class Strategy(Protocol):
    """How a run uses the cards, decided before any model loads."""

    def dp_size(self, world: int) -> int:
        """How many data-parallel replicas ``world`` ranks form (the batch math's third factor)."""
        ...

    def check_batch(self, batch: BatchMath) -> None:
        """Raise a UserError when the resolved batch math does not suit this way of using the cards."""
        ...

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> TrainEngine: ...


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


@dataclass(frozen=True)
class LayerSplitSettings:
    """One process, the layers balanced over ``devices`` (``--device-map-devices``; default: every GPU)."""

    devices: str | None = None

    def dp_size(self, world: int) -> int:
        if world > 1:
            raise UserError(
                "--device-map",
                f"layer split runs in one process, not {world}",
                "run `python train.py --device-map balanced`",
            )
        return 1

    def check_batch(self, batch: BatchMath) -> None:
        return None

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> LayerSplitEngine:
        return LayerSplitEngine.build(build_model, ds_config, parse_devices(self.devices), seq_len)


def choose(
    ds: dict[str, Any],
    source: str,
    device_map: str | None,
    devices: str | None,
    gradient_checkpointing: bool,
    lora: LoraSpec | None,
) -> Strategy:
    """The way to use the cards: a "pipeline" section in the DeepSpeed config (``ds``, after overrides), a layer
    split (``--device-map``), or ZeRO data parallel."""
    pipe = PipelineSettings.from_ds(ds, source) if "pipeline" in ds else None
    if lora is not None and (pipe is not None or device_map):
        raise UserError("--lora", "LoRA runs on the ZeRO engine only", "use a ZeRO preset without --device-map")
    if device_map:
        return LayerSplitSettings(devices)
    return pipe or ZeroSettings(gradient_checkpointing, lora)


__all__ = [
    "Batch",
    "LayerSplitSettings",
    "PipelineSettings",
    "Strategy",
    "TrainEngine",
    "ZeroSettings",
    "choose",
]
