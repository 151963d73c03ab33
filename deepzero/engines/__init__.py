"""The ways to use the cards, behind one interface (``TrainEngine``).

Each way is one module with a settings object (:class:`EngineSettings`), chosen once while the run is planned
(:func:`choose`), that knows its data-parallel size, checks the batch math it needs, tells the memory planner what
it holds (``plan_terms``), and builds its engine:

- ``zero.ZeroSettings`` → ``zero.ZeroEngine``: DeepSpeed ZeRO-0/1/2/3 data parallel (LoRA is a model transform there),
  optionally with every sequence split over ``sequence_parallel_size`` ranks (``deepzero.sequence_parallel``);
- ``pipeline.PipelineSettings`` → ``pipeline.PipelineEngine``: DeepSpeed's PipelineModule, one stage per rank group;
- ``layer_split.LayerSplitSettings`` → ``layer_split.LayerSplitEngine``: one process, layers balanced over the cards.

A new way plugs in as one module with an engine class implementing ``TrainEngine`` and a settings class with
``dp_size``, ``check_batch``, ``plan_terms`` and ``build``, selected in :func:`choose`.
"""

from __future__ import annotations

from typing import Any, Protocol

from deepzero.adapters.lora import LoraSpec
from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, ModelFactory, TrainEngine
from deepzero.engines.layer_split import LayerSplitSettings
from deepzero.engines.pipeline import PipelineSettings
from deepzero.engines.zero import ZeroSettings
from deepzero.errors import UserError
from deepzero.plan.setup import EngineTerms


class EngineSettings(Protocol):
    """How a run uses the cards, decided before any model loads."""

    def dp_size(self, world: int) -> int:
        """How many data-parallel replicas ``world`` ranks form (the batch math's third factor)."""
        ...

    def check_batch(self, batch: BatchMath) -> None:
        """Raise a UserError when the resolved batch math does not suit this way of using the cards."""
        ...

    def plan_terms(self) -> EngineTerms:
        """What the memory planner models of this way of using the cards (``deepzero.plan.setup.EngineTerms``)."""
        ...

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> TrainEngine: ...


def choose(
    ds: dict[str, Any],
    source: str,
    device_map: str | None,
    devices: str | None,
    gradient_checkpointing: bool,
    lora: LoraSpec | None,
    sequence_parallel: int | None = None,
) -> EngineSettings:
    """The way to use the cards: a "pipeline" section in the DeepSpeed config (``ds``, after overrides), a layer
    split (``--device-map``), or ZeRO data parallel, with ``sequence_parallel_size`` ranks per sequence."""
    pipe = PipelineSettings.from_ds(ds, source) if "pipeline" in ds else None
    if lora is not None and (pipe is not None or device_map):
        raise UserError("--lora", "LoRA runs on the ZeRO engine only", "use a ZeRO preset without --device-map")
    sp = sequence_size(ds, source, sequence_parallel)
    if sp > 1 and (pipe is not None or device_map):
        way = f'the "pipeline" section of {source}' if pipe is not None else "--device-map"
        raise UserError(
            f"sequence_parallel_size {sp}",
            f"sequence parallelism runs on the ZeRO engine only, not with {way}",
            "use a ZeRO preset (ds_configs/zero2.json or zero3.json) without --device-map",
        )
    zero = ds.get("zero_optimization", {})
    if sp > 1 and zero.get("stage") == 3 and zero.get("reduce_scatter") is False:
        raise UserError(
            f"{source} zero_optimization.reduce_scatter",
            "false mixes ZeRO-3's two gradient reductions, which scale sequence-parallel gradients differently",
            "drop the key or set it true (the default) with sequence_parallel_size > 1",
        )
    if device_map:
        return LayerSplitSettings(devices)
    return pipe or ZeroSettings(gradient_checkpointing, lora, sp)


def sequence_size(ds: dict[str, Any], source: str, flag: int | None) -> int:
    """Ranks per sequence: ``--sequence-parallel`` or the config's ``"sequence_parallel_size"`` (1 without)."""
    value = ds.get("sequence_parallel_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(
            f"{source} sequence_parallel_size", f"must be an integer >= 1, got {value!r}", "set it to e.g. 3"
        )
    if flag is not None and "sequence_parallel_size" in ds and flag != value:
        raise UserError(
            f"--sequence-parallel {flag}",
            f'{source} says "sequence_parallel_size": {value}',
            "pass one of them, or the same number",
        )
    return flag or value


__all__ = [
    "Batch",
    "EngineSettings",
    "LayerSplitSettings",
    "PipelineSettings",
    "TrainEngine",
    "ZeroSettings",
    "choose",
]
