"""ZeRO data parallel: every rank runs the whole model on its own micro-batches; DeepSpeed partitions the optimizer
state (ZeRO-1), gradients (ZeRO-2) and parameters (ZeRO-3), optionally offloaded to CPU RAM.

LoRA is a model transform applied here, between building the model and ``deepspeed.initialize``, plus an export
variant that merges the adapters (``deepzero.adapters.exporters``: from the base's own files where it has them). So
is sequence parallelism (``deepzero.sequence_parallel``): each sequence group's ranks read the same rows, train on
their slices of them, and DeepSpeed reduces the gradients over its sequence × data-parallel groups
(``mpu=parallel_state_sp``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from deepzero import modeling
from deepzero import sequence_parallel as sp
from deepzero.adapters import checkpoint as adapter_checkpoint
from deepzero.adapters import quant
from deepzero.adapters.exporters import lora_exporter
from deepzero.adapters.lora import LoraSpec, apply_lora
from deepzero.adapters.partitioned_load import fingerprint, load_in_turns
from deepzero.dsconfig import BatchMath
from deepzero.engines.base import Batch, DeepSpeedBacked, ModelFactory, mean_eval_loss
from deepzero.errors import UserError
from deepzero.hf_export import ExportReport, export_hf
from deepzero.losses.objectives import Objective, PreferenceSettings, build_objective
from deepzero.plan.setup import EngineTerms

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
        sequence: sp.SequenceGroups | None = None,
        gradient_factor: float = 1.0,
        objective: Objective | None = None,
    ) -> None:
        self.engine = engine
        self.objective = objective or build_objective(None)
        self.model = model
        self.device = torch.device(get_accelerator().current_device_name())
        self.sequence = sequence
        """Sequence parallelism: this rank's group and slice (None: whole rows on every rank)."""
        self.dp_rank = sequence.dp_rank if sequence else dist.get_rank()
        self.dp_size = sequence.dp_size if sequence else dist.get_world_size()
        self.gradient_factor = gradient_factor
        """What the backward loss is multiplied by so that the slices' gradients are summed over the sequence group
        and averaged over data parallel (:func:`stage3_gradient_factor`; 1 without ZeRO-3's reduce-scatter)."""
        self.zero_ranks = dist.get_world_size()
        """Ranks ZeRO partitions over (its checkpoint's file count): the whole world, sequence groups included."""
        self._exporter = exporter
        self._keep_alive = keep_alive  # ZeRO-3: HfDeepSpeedConfig must live as long as the engine
        self.partitioned_at_load = partitioned_at_load
        """ZeRO-3 split the parameters while the model was built: no rank ever held the whole model."""
        self.seq_len = 0
        """The data's row length (0: unknown), for the header's sequence-parallel padding."""
        self.four_bit: quant.FourBit | None = None
        """The 4-bit base under the adapters (QLoRA), for the header."""
        self.base_print: dict[str, Any] | None = None
        """QLoRA: the loaded base's fingerprint; its checkpoints hold the adapters only and record this."""
        self.base_source = ""
        """QLoRA: where the base was read (the model folder or hub id), for the errors."""

    @classmethod
    def build(
        cls,
        build_model: ModelFactory,
        ds_config: dict[str, Any],
        gradient_checkpointing: bool = False,
        lora: LoraSpec | None = None,
        sequence_parallel: int = 1,
        preference: PreferenceSettings | None = None,
        grpo: Any = None,
        seed: int = 0,
        four_bit: quant.FourBit | None = None,
        base_source: str | None = None,
    ) -> ZeroEngine:
        """Instantiate the model (partitioned at load under ZeRO-3), apply LoRA, wrap it in a DeepSpeed engine
        (with DeepSpeed's sequence-parallel groups as its ``mpu`` when ``sequence_parallel`` > 1)."""
        sequence = sp.SequenceGroups.create(sequence_parallel) if sequence_parallel > 1 else None
        stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        keep_alive = modeling.zero3_context(ds_config) if stage == 3 else None
        prints = None
        if four_bit is not None and four_bit.load_on_host:  # in the training dtype, as DeepSpeed casts the others
            model, prints = load_in_turns(lambda: cast_the_unpartitioned(build_model(), ds_config), ds_config)
        else:
            model = build_model()
            prints = fingerprint(model) if four_bit is not None else None
        partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
        if gradient_checkpointing and not model.is_gradient_checkpointing:  # (the offloaded kind is set already)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if sequence is not None:
            sp.install(model, sequence)
        if four_bit is not None:  # the 4-bit base frozen
            model = quant.prepare(model)
        if lora is not None:  # after the build (ZeRO-3: already partitioned), before initialize
            model = apply_lora(model, lora)
        if partitioned:
            cast_the_unpartitioned(model, ds_config)
        params = [p for p in model.parameters() if p.requires_grad]
        mpu = None
        if sequence is not None:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config, mpu=mpu)
        factor = stage3_gradient_factor(engine.optimizer, params[0], sequence.size) if sequence and stage == 3 else 1.0
        exporter: Exporter = export_hf
        if lora is not None:  # the adapters merged into the 16-bit base read again from its files, where it has them
            exporter = lora_exporter(model, base_source, four_bit is not None)
        objective = build_objective(preference, grpo, seed)
        built = cls(engine, model, exporter, keep_alive, partitioned, sequence, factor, objective)
        built.four_bit = four_bit
        if four_bit is not None and prints is not None:
            states = len(quant.quant_states(model))
            built.base_print = adapter_checkpoint.base_fingerprint(prints, four_bit.storage, states)
            built.base_source = base_source or ""
        return built

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool = False) -> None:
        """A run over a 4-bit base saves its adapters, their optimizer state and the base's fingerprint, not the base
        (``deepzero.adapters.checkpoint``)."""
        if self.base_print is None:
            return super().save_checkpoint(save_dir, tag, client_state, save_latest)
        with adapter_checkpoint.adapters_only(self.engine):
            self.engine.save_checkpoint(
                save_dir,
                tag=tag,
                client_state=client_state | {adapter_checkpoint.BASE_KEY: self.base_print},
                save_latest=save_latest,
                exclude_frozen_parameters=True,
            )

    def load_checkpoint(
        self, load_dir: str, tag: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> tuple[str | None, dict[str, Any]]:
        if self.base_print is None:
            return super().load_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states)
        path, client_state = self.engine.load_checkpoint(
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            custom_load_fn=adapter_checkpoint.load_adapters,
        )
        if path is not None:
            saved = (client_state or {}).get(adapter_checkpoint.BASE_KEY)
            where = str(Path(load_dir) / tag)
            adapter_checkpoint.check_same_base(saved, self.base_print, where, self.base_source)
        return path, client_state

    def describe(self) -> str:
        where = "  partitioned at load" if self.partitioned_at_load else ""
        where += self.four_bit.describe() if self.four_bit is not None else ""
        if self.sequence is None:
            return where
        size = self.sequence.size
        padded = sp.padded_length(self.seq_len, size) if self.seq_len else 0
        padding = f", rows of {self.seq_len} padded to {padded}" if padded > self.seq_len else ""
        return (
            f"{where}  sequence parallel {size} × data-parallel {self.dp_size}"
            f" (each sequence in {2 * size} pieces, 2 per rank, keys/values all-gathered{padding})"
        )

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Under sequence parallelism the targets are counted on whole rows (once per sequence group) and each rank
        trains on its slice: DeepSpeed sums the slices' gradients over the group and averages over data parallel."""
        engine = self.engine
        micro = self.objective.rollout(engine, batches, engine.gradient_accumulation_steps())  # GRPO: generates
        group = self.sequence.dp_group if self.sequence else None
        normalizer = self.objective.normalizer(micro, self.dp_size, group)
        if self.sequence is not None:
            micro = [self.sequence.shard(batch) for batch in micro]
        total = torch.zeros((), device=self.device)
        for batch in micro:
            loss = self.objective.loss(engine, batch, normalizer)
            engine.backward(loss * self.gradient_factor)  # divides by the accumulation steps; averages the ranks
            engine.step()
            total += loss.detach().float()
        return total * (self.sequence.size if self.sequence else 1) / len(micro)

    def eval_loss(self, batches: Iterator[Batch], micro_batches: int) -> float:
        if self.sequence is not None:
            batches = map(self.sequence.shard, batches)
        return mean_eval_loss(self.engine, batches, self.objective)

    def export(self, tokenizer: Any, out_dir: Path, probe: Batch) -> ExportReport | None:
        if "input_ids" not in probe:  # a prompts batch (GRPO): the probe is its first prompt
            probe = {"input_ids": probe["prompt_ids"][:1, probe["prompt_mask"][0].bool()]}
        with sp.whole_rows(self.model):  # every rank runs the probe's whole row with the model's own attention
            return self._exporter(self.engine, tokenizer, out_dir, probe)

    @torch.no_grad()
    def weights_finite(self) -> bool:
        params = [p for p in self.engine.module.parameters() if not quant.is_packed(p)]  # 4-bit bytes: not floats
        return all(bool(torch.isfinite(local_values(p)).all()) for p in params)


AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
"""ZeRO-3's reduce-scatter of gradients (``__avg_scatter_grads``), which :func:`stage3_gradient_factor` probes."""


def cast_the_unpartitioned(model: nn.Module, ds_config: dict[str, Any]) -> nn.Module:
    """DeepSpeed casts a model to the training dtype only where it partitions the model itself; after a load that
    partitioned the base (``zero.Init``), the parameters added since (LoRA adapters, fp32 from peft) are cast here,
    as they are in every other engine (``modeling.cast_parameters`` leaves the partitioned ones alone), and so are
    the modules a 4-bit load keeps in fp32 (DeepSeek's routers) before the base is partitioned."""
    if ds_config.get("bf16", {}).get("enabled"):
        modeling.cast_parameters(model, torch.bfloat16)
    elif ds_config.get("fp16", {}).get("enabled"):
        modeling.cast_parameters(model, torch.float16)
    return model


def stage3_gradient_factor(optimizer: Any, param: Any, size: int) -> float:
    """What ZeRO-3's backward loss must be multiplied by under sequence parallelism over ``size`` ranks, measured
    once at start (every rank calls it): a probe gradient of ones through the optimizer's own reduce-scatter. The
    slices' gradients must be summed over the sequence group and averaged over data parallel, which makes the probe
    ``size``. DeepSpeed 0.19.8 averages over every rank, ignoring ``sequence_parallel_size`` (the probe is 1: the
    factor is ``size``); a release that honours it gives ``size`` and the factor 1. Anything else is refused."""
    fix = "train with ZeRO-2 (ds_configs/zero2.json) under sequence parallelism, or pin deepspeed==0.19.8"
    reduce = getattr(optimizer, AVG_SCATTER, None)
    if reduce is None:
        raise UserError("zero_optimization.stage 3", "this DeepSpeed's ZeRO-3 gradient reduction cannot be probed", fix)
    group = getattr(param, "ds_process_group", None)
    ranks = dist.get_world_size(group)
    probe = SimpleNamespace(grad=torch.ones(ranks * 4, dtype=torch.float32, device=param.device))
    if group is not None:
        probe.ds_process_group = group
    parts = reduce([probe], torch.float32)
    measured = torch.cat([p.float().reshape(-1) for p in parts])
    for candidate in (1.0, float(size)):
        if torch.allclose(measured, torch.full_like(measured, candidate), rtol=1e-4):
            return size / candidate
    raise UserError(
        "zero_optimization.stage 3",
        f"a probe gradient of ones came out of ZeRO-3's reduce-scatter as {measured.mean().item():.4g} on"
        f" {ranks} ranks with sequence groups of {size}: neither the average (1) nor the sequence sum ({size})",
        fix,
    )


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
    sequence_parallel: int = 1
    """Ranks per sequence (``"sequence_parallel_size"``); the data-parallel size is world / this."""
    preference: PreferenceSettings | None = None
    """The preference loss of a preference data folder (None: the LM loss)."""
    grpo: Any = None
    """GRPO's settings for a prompts data folder (``deepzero.losses.grpo.settings.GRPOSettings``; None: no GRPO)."""
    seed: int = 0
    """The run's seed (GRPO's sampling streams derive from it)."""
    four_bit: quant.FourBit | None = None
    """A 4-bit base under the LoRA adapters (QLoRA), decided with the precision (``run.plan_four_bit``)."""
    base_source: str | None = None
    """Where a LoRA run's 16-bit base is read again for its export (folder or hub id; None: a random-init model),
    shard by shard (``deepzero.adapters.exporters``)."""

    def dp_size(self, world: int) -> int:
        if world % self.sequence_parallel:
            raise UserError(
                f"sequence_parallel_size {self.sequence_parallel}",
                f"the world of {world} ranks does not split into groups of {self.sequence_parallel}",
                f"launch a multiple of {self.sequence_parallel} ranks or set sequence_parallel_size to a divisor of"
                f" {world}",
            )
        return world // self.sequence_parallel

    def check_batch(self, batch: BatchMath) -> None:
        return None

    def plan_terms(self) -> EngineTerms:
        return EngineTerms(
            "zero", self.gradient_checkpointing, self.lora, self.sequence_parallel, four_bit=self.four_bit is not None
        )

    def build(self, build_model: ModelFactory, ds_config: dict[str, Any], seq_len: int) -> ZeroEngine:
        engine = ZeroEngine.build(
            build_model,
            ds_config,
            self.gradient_checkpointing,
            self.lora,
            self.sequence_parallel,
            self.preference,
            self.grpo,
            self.seed,
            self.four_bit,
            self.base_source,
        )
        engine.seq_len = seq_len
        return engine
