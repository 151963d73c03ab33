"""What one training run is, for the planner: the ``Setup`` (ZeRO stage, offload, layout, batch, LoRA, memory
savers) read from a ds_configs preset, or from what a run's RunPlan decided (``run_setup``)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from transformers import PretrainedConfig

from deepzero.adapters.lora import EXPERTS
from deepzero.errors import UserError
from deepzero.plan.arch import Arch
from deepzero.precision import requested_precision
from deepzero.sequence_parallel import padded_length

if TYPE_CHECKING:
    from deepzero.dsconfig import ResolvedConfig

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


@dataclass(frozen=True)
class ZeroKnobs:
    """The ``zero_optimization`` sizes that cost memory, in elements (DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    """None = DeepSpeed's default: on for stage 3, off for stages 1-2."""
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000


@dataclass(frozen=True)
class PipelineLayout:
    """DeepSpeed's PipelineModule (``engines.pipeline``): [embedding, decoder × L, head] cut into ``stages``; each
    stage's ranks hold only its layers, with ZeRO-1 / BF16_Optimizer partitioning over the data-parallel replicas."""

    stages: int
    partition: str = "parameters"
    """As ``PipelineSettings.partition``: ``parameters``, ``uniform`` or ``type:DecoderStage``."""
    checkpoint_interval: int = 0
    """``activation_checkpoint_interval``: recompute every N decoder layers in backward (0: off)."""
    fp32_grad_accum: bool = True
    """``data_types.grad_accum_dtype`` fp32: BF16_Optimizer keeps a whole fp32 gradient buffer of the stage."""


@dataclass(frozen=True)
class LayerSplitLayout:
    """One process, the layers over cards (``engines.layer_split``): card k holds layers ``cuts[k]:cuts[k+1]``, the
    embedding (k = 0) or the final norm and lm_head (the last card), their gradients and fp32 AdamW state."""

    cuts: tuple[int, ...]
    """N+1 cut points over the decoder layers, as ``placement.plan_placement`` chose them."""

    @property
    def cards(self) -> int:
        return len(self.cuts) - 1


Layout = PipelineLayout | LayerSplitLayout | None
"""How the run uses the cards; None = ZeRO data parallel over ``world_size`` ranks."""


@dataclass(frozen=True)
class EngineTerms:
    """What the planner models of a run's engine, handed to it as data by the engine's settings (``deepzero.engines``:
    each settings class's ``plan_terms``): ZeRO data parallel, a pipeline or a layer split, and what it holds."""

    kind: Literal["zero", "pipeline", "layer split"] = "zero"
    checkpointing: bool = False
    """Activation checkpointing (ZeRO's ``--gradient-checkpointing``; a pipeline's ``checkpoint_interval`` > 0)."""
    lora: Any = None
    """The LoRA adapters (``deepzero.adapters.lora.LoraSpec``; None: full fine-tuning)."""
    sequence_parallel: int = 1
    four_bit: bool = False
    """ZeRO's base in 4 bits under the adapters (``--load-in-4bit``)."""
    stages: int = 1
    partition: str = "parameters"
    checkpoint_interval: int = 0
    """The pipeline's: as ``PipelineLayout``'s."""
    devices: tuple[str | int, ...] = ()
    """The layer split's cards (``--device-map-devices``, parsed)."""


class PlannedEngine(Protocol):
    """A run's engine settings as the planner takes them: anything that hands over its :class:`EngineTerms`."""

    def plan_terms(self) -> EngineTerms: ...


@dataclass(frozen=True)
class SaverTerms:
    """The long-sequence decisions (``deepzero.memory_savers.MemorySavers``) the planner models."""

    loss_tiles: int = 0
    """Tiles of the tiled LM loss per micro-batch (ceil(vocab / hidden)); 0 = whole [tokens × vocab] logits."""
    offload: bool = False
    """Checkpointed layer inputs in host memory (only with activation checkpointing)."""
    tiled_mlp: bool = False
    """Dense MLPs and shared experts in sequence tiles."""
    mlp_tile_count: int = 0
    """Tiles of the tiled MLP; 0 = DeepSpeed's rule ceil(seq_len / hidden) at the planned length."""

    @classmethod
    def of(cls, savers: Any) -> SaverTerms:
        """The terms of a run's ``MemorySavers``."""
        loss_tiles = savers.loss.tiles_per_vocab if savers.loss.enabled else 0
        return cls(loss_tiles, savers.offload_checkpoints, savers.mlp_tiles > 0, savers.mlp_tiles)

    @classmethod
    def choose(cls, arch: Arch, tiled_loss: bool = True, offload: bool = False, tiled_mlp: bool = False) -> SaverTerms:
        """As ``MemorySavers.choose`` decides for these flags (train.py's defaults: tiled loss on, the rest off)."""
        tiles = math.ceil(arch.vocab / arch.hidden)
        return cls(tiles if tiled_loss and tiles > 1 else 0, offload, tiled_mlp)

    def mlp_tiles(self, arch: Arch, seq_len: int) -> int:
        """Sequence tiles of each dense MLP at ``seq_len`` (1 = untiled)."""
        if not self.tiled_mlp:
            return 1
        return max(1, min(seq_len, self.mlp_tile_count or math.ceil(seq_len / arch.hidden)))

    def label(self) -> str:
        parts = ["tiled loss" if self.loss_tiles else "untiled loss"]
        return " + ".join(parts + ["offload"] * self.offload + ["tiled MLP"] * self.tiled_mlp)


@dataclass(frozen=True)
class GrpoTerms:
    """GRPO (``--grpo``): each rank generates ``rows`` completions together (one prompt's ``generations`` unless
    set), then trains on rows of prompt + completion (``Setup.seq_len``; ``micro_batch`` counts completions, as
    TRL's batch does)."""

    generations: int = 8
    """G, ``--num-generations``: completions of one prompt."""
    prompt_len: int = 512
    """Longest prompt; the completion is ``seq_len - prompt_len``."""
    reference_copy: bool = False
    """β > 0 without LoRA: a frozen copy of the starting weights on every rank."""
    rows: int | None = None
    """Completion rows per ``generate`` call (``--generation-batch-size``); None: one group (``generations``)."""

    @property
    def batch_rows(self) -> int:
        return self.rows or self.generations


@dataclass(frozen=True)
class Setup:
    """One training configuration to size: engine layout, ZeRO stage, offload, precision, batch shape, LoRA, and
    how the weights load. Built once from the run's decisions (``run_setup``) or by the planner's table."""

    stage: int
    world_size: int
    micro_batch: int = 1
    seq_len: int = 2048
    offload_optimizer: bool = False
    offload_params: bool = False
    precision: str = "bf16"
    checkpointing: bool = False
    lora_rank: int = 0
    """0 = full fine-tuning; otherwise the LoRA rank (``ModelStats.lora_shapes`` adapted, base weights frozen)."""
    attention: str = "sdpa"
    """sdpa (flash/memory-efficient kernels, no s² term) or eager (stores the s×s attention probabilities)."""
    zero: ZeroKnobs = field(default_factory=ZeroKnobs)
    layout: Layout = None
    pretrained: bool = False
    """Weights load with from_pretrained in the training dtype; False: a random-init model built in fp32."""
    accum: int = 1
    """Micro-batches per optimizer step (a pipeline keeps up to ``stages`` of them in flight)."""
    savers: SaverTerms = field(default_factory=SaverTerms)
    """Tiled loss, offloaded checkpoints, tiled MLP (default: none, the model's own loss)."""
    sequence_parallel: int = 1
    """Ranks each sequence is split over (``deepzero.sequence_parallel``): a rank holds ``seq_len / N`` tokens of
    every row, the group's keys and values of the layer it computes, and one query chunk's mask."""
    grpo: GrpoTerms | None = None
    """GRPO's generation and reference (``plan.generation``); None: no generation."""
    four_bit: bool = False
    """The frozen base in 4 bits under the LoRA adapters (``--load-in-4bit``, ``deepzero.adapters.quant``): every weight
    ``ModelStats.four_bit_mask`` marks as NF4 codes plus its quantisation constants, the rest in the training dtype;
    loaded whole on every card under ZeRO-0/1/2, and in host RAM one rank at a time under ZeRO-3, each card keeping
    its partition (``deepzero.adapters.partitioned_load``)."""
    expert_adapters: bool = False
    """LoRA on the fused routed experts (``--lora targets=experts``): the export merges the engine's whole model in
    memory, as for a random-init base, not the base's files shard by shard (``deepzero.adapters.exporters``)."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a slice of each row, padded to a multiple of 2N, under sequence
        parallelism: ``sequence_parallel.padded_length``)."""
        return self.micro_batch * padded_length(self.seq_len, self.sequence_parallel) // self.sequence_parallel

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise UserError("zero_optimization.stage", f"{self.stage} is not a ZeRO stage", "use 0, 1, 2 or 3")
        if self.offload_params and self.stage != 3:
            raise UserError("offload_param", "parameter offload needs ZeRO stage 3", "set stage 3 or drop it")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise UserError("precision", f"unknown precision {self.precision!r}", "use bf16, fp16 or fp32")
        if isinstance(self.layout, PipelineLayout) and (self.stage > 1 or self.world_size % self.layout.stages):
            raise UserError("pipeline", "needs ZeRO stage 0 or 1 and stages dividing the world", "see PipelineSettings")
        if self.grpo is not None and not 0 < self.grpo.prompt_len < self.seq_len:
            raise UserError(
                "--grpo",
                f"prompts of {self.grpo.prompt_len} tokens leave no completion in {self.seq_len}",
                "raise --seq-len above --prompt-len",
            )
        if self.four_bit and (not self.lora_rank or self.layout is not None or self.offload_params):
            raise UserError(
                "--load-in-4bit",
                "a 4-bit base needs LoRA on the ZeRO engine without parameter offload",
                "add --lora, use a ZeRO preset, drop offload_param",
            )

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the ZeRO partition count."""
        if isinstance(self.layout, PipelineLayout):
            return self.world_size // self.layout.stages
        return 1 if isinstance(self.layout, LayerSplitLayout) else self.world_size

    def label(self) -> str:
        lora = f" + {'QLoRA' if self.four_bit else 'LoRA'} r{self.lora_rank}" if self.lora_rank else ""
        if isinstance(self.layout, PipelineLayout):
            return f"pipeline {self.layout.stages} stages × data-parallel {self.dp_size} (ZeRO-{self.stage})"
        if isinstance(self.layout, LayerSplitLayout):
            return f"layer split over {self.layout.cards} cards"
        off = [w for w, on in (("opt", self.offload_optimizer), ("param", self.offload_params)) if on]
        return f"ZeRO-{self.stage}" + (f" offload {'+'.join(off)}" if off else "") + lora


def _int(value: Any, auto: int) -> int:
    """A size from a ds config: "auto" -> ``auto``; JSON floats like 2e8 -> int."""
    if value == "auto":
        return auto
    return value if isinstance(value, int) else int(float(value))


def offloads(zero: dict[str, Any], key: str) -> bool:
    """Whether ``zero_optimization[key]`` (``offload_optimizer`` or ``offload_param``) moves states off the card
    (absent, null or device "none": no)."""
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


def setup_from_ds_config(
    ds: dict[str, Any],
    *,
    world_size: int,
    seq_len: int,
    hidden_size: int,
    checkpointing: bool = False,
    lora_rank: int = 0,
    micro_batch: int | None = None,
    pretrained: bool = False,
    savers: SaverTerms | None = None,
    four_bit: bool = False,
) -> Setup:
    """Read the memory-relevant keys of a DeepSpeed config; "auto" sizes get HF's hidden-size rules."""
    zero = ds.get("zero_optimization", {})
    h2 = hidden_size * hidden_size
    knobs = ZeroKnobs(
        reduce_bucket_size=_int(zero.get("reduce_bucket_size", 500_000_000), h2),
        allgather_bucket_size=_int(zero.get("allgather_bucket_size", 500_000_000), h2),
        overlap_comm=zero.get("overlap_comm"),
        prefetch_bucket_size=_int(zero.get("stage3_prefetch_bucket_size", 50_000_000), int(0.9 * h2)),
        param_persistence_threshold=_int(zero.get("stage3_param_persistence_threshold", 100_000), 10 * hidden_size),
        model_persistence_threshold=_int(zero.get("stage3_model_persistence_threshold", sys.maxsize), sys.maxsize),
        max_live_parameters=_int(zero.get("stage3_max_live_parameters", 1_000_000_000), 1_000_000_000),
        sub_group_size=_int(zero.get("sub_group_size", 1_000_000_000), 1_000_000_000),
    )
    precision = requested_precision(ds)
    if micro_batch is None:
        micro_batch = _int(ds.get("train_micro_batch_size_per_gpu", 1), 1)
    return Setup(
        stage=int(zero.get("stage", 0)),
        world_size=world_size,
        micro_batch=micro_batch,
        seq_len=seq_len,
        offload_optimizer=offloads(zero, "offload_optimizer"),
        offload_params=offloads(zero, "offload_param"),
        precision=precision,
        checkpointing=checkpointing,
        lora_rank=lora_rank,
        zero=knobs,
        pretrained=pretrained,
        savers=savers or SaverTerms(),
        four_bit=four_bit,
    )


def load_preset(name: str, directory: Path = DS_CONFIG_DIR) -> dict[str, Any]:
    """A ds_configs preset as a dict ("_" comment keys dropped); the stage/offload implied by its name if absent."""
    path = directory / f"{name}.json"
    if path.is_file():
        return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    stage = 3 if name.startswith("zero3") else 2
    zero: dict[str, Any] = {"stage": stage}
    if name.endswith("_offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"bf16": {"enabled": name != "zero2"}, "fp16": {"enabled": name == "zero2"}, "zero_optimization": zero}


def layer_split_cuts(
    config: PretrainedConfig, devices: Sequence[Any], seq_len: int, micro_batch: int
) -> tuple[int, ...]:
    """The layer cut points the layer split engine will use: ``plan_placement`` called as ``place_model`` calls it
    (when that placement finds the cards too small, the same split over equal unbounded cards)."""
    from deepzero.placement import plan_placement

    kw: dict[str, Any] = {"training": True, "seq_len": seq_len, "micro_batch": micro_batch}
    try:
        cards = plan_placement(config, devices, **kw).cards
    except UserError:
        cards = plan_placement(config, devices, dict.fromkeys(range(len(devices)), 2**60), **kw).cards
    return (*(row.layers.start for row in cards), cards[-1].layers.stop)


def run_setup(
    config: PretrainedConfig,
    engine: PlannedEngine,
    cfg: ResolvedConfig,
    seq_len: int,
    world_size: int,
    pretrained: bool,
    savers: SaverTerms | None = None,
) -> Setup:
    """The Setup a run trains with, from what its RunPlan decided: what the engine settings hand over
    (``engine.plan_terms()``: layout, LoRA, gradient checkpointing), the resolved config's precision and batch, pretrained or random init, the memory savers
    (``SaverTerms.of(plan.savers)``; None: none). ``cfg.ds`` is read only for the ZeRO sizes DeepSpeed is given."""
    base = setup_from_ds_config(
        cfg.ds,
        world_size=world_size,
        seq_len=seq_len,
        hidden_size=config.hidden_size,
        micro_batch=cfg.batch.micro,
        pretrained=pretrained,
        savers=savers,
    )
    base = replace(base, precision=cfg.precision, accum=cfg.batch.accum)
    terms = engine.plan_terms()
    if terms.kind == "zero":
        return replace(
            base,
            checkpointing=terms.checkpointing,
            lora_rank=terms.lora.r if terms.lora else 0,
            sequence_parallel=terms.sequence_parallel,
            four_bit=terms.four_bit,
            expert_adapters=terms.lora is not None and EXPERTS in terms.lora.targets,
        )
    if terms.kind == "pipeline":
        accum_dtype = cfg.ds.get("data_types", {}).get("grad_accum_dtype")
        interval = terms.checkpoint_interval
        layout = PipelineLayout(terms.stages, terms.partition, interval, fp32_grad_accum=accum_dtype == "fp32")
        return replace(base, layout=layout, checkpointing=interval > 0)
    if terms.kind == "layer split":
        cuts = layer_split_cuts(config, list(terms.devices), seq_len, cfg.batch.micro)
        return Setup(
            savers=base.savers,
            stage=0,
            world_size=1,
            micro_batch=cfg.batch.micro,
            seq_len=seq_len,
            precision=cfg.precision,
            layout=LayerSplitLayout(cuts),
            pretrained=pretrained,
            accum=cfg.batch.accum,
        )
    raise TypeError(f"no memory plan for {type(engine).__name__}")
