"""Memory planner: will a model train under ZeRO 1/2/3 on these cards? Reads only the config (meta device).

``python -m deepzero.plan --model deepseek-coder-1.3b --gpus 3 --gpu-mem 24 --cpu-mem 128 --seq-len 2048``
prints per-card GPU memory (parameters, gradients, optimizer, activations, logits, buffers) and host RAM for
every ZeRO stage / offload / checkpointing / LoRA combination, marks what fits, and recommends a ds_configs
preset with the largest micro-batch that fits. Formulas and sources: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from deepzero.errors import UserError
from deepzero.flops import routed_experts

if TYPE_CHECKING:
    from deepzero.dsconfig import ResolvedConfig
    from deepzero.engines import EngineSettings
from deepzero.lora import LoraSpec
from deepzero.losses.tiled import MIN_TILE_ROWS
from deepzero.modeling import planning_config
from deepzero.precision import requested_precision
from deepzero.presets import PRESETS
from deepzero.sequence_parallel import MASK_ELEMENTS

GiB = 2**30
ADAM_K = 12
"""Bytes per trainable parameter of fp32 optimizer state: master copy 4 + Adam m 4 + v 4 (ZeRO paper's K)."""
CUDA_RESERVE = 1 * GiB
"""CUDA context, cuBLAS workspace and NCCL buffers: on the card but outside torch's allocator."""
FRAGMENTATION = 0.05
"""Share of allocated bytes the caching allocator loses to fragmentation."""
HOST_PER_RANK = 3 * GiB
"""Host RAM of one training process before any model bytes (Python, torch, CUDA host state)."""
LORA_RANK = 16
PRESET_ORDER = ("zero2_bf16", "zero2", "zero3", "zero2_offload", "zero3_offload")
"""ds_configs presets, fastest first: the recommendation is the first one that fits."""
MAX_MICRO_BATCH = 64
SEQ_STEP = 1024
"""Granularity of the longest-sequence search (tokens)."""
MAX_SEQ_SEARCH = 2**20
"""Longest sequence the search tries (tokens)."""
DS_CONFIG_DIR = Path(__file__).resolve().parents[1] / "ds_configs"


# ----------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Arch:
    """The shape numbers the activation formula needs, read from a Transformers config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    q_lora_rank: int | None = None
    """MLA (DeepSeek-V2/V3) low-rank query projection; None = plain q_proj."""
    kv_lora_rank: int | None = None
    """MLA compressed key/value width; None = standard (GQA/MHA) attention."""
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    moe_layers: int = 0
    """Decoder layers whose MLP is a mixture of experts."""
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    """Intermediate width of the always-on shared experts (moe_intermediate × n_shared_experts)."""
    max_positions: int = 0
    """The config's max_position_embeddings (0: not given): the context the checkpoint was trained for."""


@dataclass(frozen=True)
class ModelStats:
    """Parameter counts of a model, from a meta-device instance (no weights)."""

    name: str
    arch: Arch
    param_numels: tuple[int, ...]
    """Numel of every parameter in ``model.parameters()`` order (what DeepSpeed flattens and partitions)."""
    total: int
    embedding: int
    """Input embedding + lm_head (once if tied)."""
    routed_experts: int
    active: int
    """Parameters one token passes through: routed experts counted by experts_per_token / experts."""
    largest_module: int
    """Most parameters directly owned by one module: what ZeRO-3 gathers at once (DeepSpeed's 'largest layer')."""
    lora_shapes: tuple[tuple[int, int], ...]
    """(in, out) of every Linear a LoRA adapter wraps: all linears in the decoder layers, or those a ``LoraSpec``
    selects (a fused routed-expert parameter [E, a, b] counts as (E·a, E·b): peft's rank is per expert)."""
    stage_numels: tuple[int, ...] = ()
    """Parameters of [embedding, decoder layer 0 .. L-1, final norm + lm_head]: the pipeline's and the layer
    split's units (an lm_head tied to the embedding is counted in the embedding)."""
    moe_mask: tuple[bool, ...] = ()
    """Per decoder layer: whether its MLP is a mixture of experts."""

    def lora_numels(self, rank: int) -> tuple[int, ...]:
        """Numel of the LoRA A and B matrices, in model order."""
        return tuple(n for i, o in self.lora_shapes for n in (rank * i, o * rank))


def _arch(config: PretrainedConfig, model: torch.nn.Module) -> Arch:
    c = config
    heads = c.num_attention_heads
    layers = list(model.model.layers)
    moe = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    experts = routed_experts(c)
    n_shared = getattr(c, "n_shared_experts", None) or 0
    moe_inter = getattr(c, "moe_intermediate_size", 0) or 0
    return Arch(
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        q_lora_rank=getattr(c, "q_lora_rank", None),
        kv_lora_rank=getattr(c, "kv_lora_rank", None),
        qk_nope_dim=getattr(c, "qk_nope_head_dim", 0) or 0,
        qk_rope_dim=getattr(c, "qk_rope_head_dim", 0) or 0,
        v_head_dim=getattr(c, "v_head_dim", 0) or 0,
        moe_layers=len(moe),
        experts=experts if moe else 0,
        experts_per_token=(getattr(c, "num_experts_per_tok", 0) or 0) if moe else 0,
        moe_intermediate=moe_inter,
        shared_intermediate=moe_inter * n_shared,
        max_positions=getattr(c, "max_position_embeddings", 0) or 0,
    )


def model_stats(config: PretrainedConfig, name: str = "model", lora: LoraSpec | None = None) -> ModelStats:
    """Count parameters by building the model on the meta device (no memory, no weights). ``lora``: count the
    adapters that spec wraps (``deepzero.lora``'s own target resolution); None: every decoder linear."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # deduplicates tied weights, like DeepSpeed sees them
    numels = tuple(p.numel() for p in params)
    arch = _arch(config, model)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = sum(numels) - routed + (routed * arch.experts_per_token // arch.experts if arch.experts else 0)
    embeds = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    embed = model.get_input_embeddings().weight.numel()
    stages = (embed, *layers, sum(numels) - embed - sum(layers))
    moe_mask = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    shapes = _lora_shapes(model, lora)
    return ModelStats(
        name, arch, numels, sum(numels), sum(embeds.values()), routed, active, largest, shapes, stages, moe_mask
    )


def _lora_shapes(model: torch.nn.Module, spec: LoraSpec | None) -> tuple[tuple[int, int], ...]:
    """(in, out) of what LoRA wraps: every decoder linear but the router (``spec`` None), or what ``spec`` selects."""
    if spec is None:
        return tuple(
            (m.in_features, m.out_features)
            for n, m in model.model.layers.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] != "gate"
        )
    from deepzero.lora import expert_param_names, resolve_targets

    targets = resolve_targets(model, spec)
    modules = dict(model.named_modules())
    shapes = [(modules[n].in_features, modules[n].out_features) for n in targets.wrapped_modules(model)]
    params = dict(model.named_parameters())
    for name in expert_param_names(model):
        if any(name.endswith(t) for t in targets.parameters):
            experts, a, b = params[name].shape  # peft ParamWrapper: A (in, r·E), B (r·E, out)
            shapes.append((experts * a, experts * b))
    return tuple(shapes)


# ----------------------------------------------------------------------------------------------- the run


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

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (a slice of each row under sequence parallelism)."""
        return self.micro_batch * self.seq_len // self.sequence_parallel

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise UserError("zero_optimization.stage", f"{self.stage} is not a ZeRO stage", "use 0, 1, 2 or 3")
        if self.offload_params and self.stage != 3:
            raise UserError("offload_param", "parameter offload needs ZeRO stage 3", "set stage 3 or drop it")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise UserError("precision", f"unknown precision {self.precision!r}", "use bf16, fp16 or fp32")
        if isinstance(self.layout, PipelineLayout) and (self.stage > 1 or self.world_size % self.layout.stages):
            raise UserError("pipeline", "needs ZeRO stage 0 or 1 and stages dividing the world", "see PipelineSettings")

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
        lora = f" + LoRA r{self.lora_rank}" if self.lora_rank else ""
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
        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None),
        offload_params=zero.get("offload_param", {}).get("device", "none") not in ("none", None),
        precision=precision,
        checkpointing=checkpointing,
        lora_rank=lora_rank,
        zero=knobs,
        pretrained=pretrained,
        savers=savers or SaverTerms(),
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


# ---------------------------------------------------------------------------------- ZeRO partitioning


@dataclass(frozen=True)
class RankStates:
    """Model-state elements one rank holds, with DeepSpeed's padding (multiply by bytes per element)."""

    params: int
    """16-bit parameters: the full flat buffer (stage 0-2) or this rank's shards + persistent copies (stage 3)."""
    persistent: int
    """Of ``params``: full copies of small ZeRO-3 parameters kept on every rank (param_persistence_threshold)."""
    grads: int
    """16-bit gradients held between backward and step."""
    optimizer: int
    """fp32 partition the optimizer updates (master weights; Adam m and v have the same size)."""
    step_chunk: int
    """Largest fp32 gradient partition materialised at once during the step."""


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rank_states(trainable: Sequence[int], frozen: Sequence[int], setup: Setup) -> list[RankStates]:
    """Per-rank elements exactly as DeepSpeed lays them out (validated in tests/test_plan.py).

    Stages 1-2 flatten the trainable parameters into one buffer padded to a multiple of 2·N and split it in N
    equal partitions; ZeRO-2's contiguous gradient buffer holds the *whole* gradient of every parameter that
    touches the rank's partition. Stage 3 splits each parameter in N shards of ceil(numel / N).
    """
    n = setup.dp_size if setup.stage > 0 else 1
    total = sum(trainable)
    frozen_total = sum(frozen)
    if setup.stage == 3:
        k = setup.zero
        shards = sum(-(-x // n) for x in trainable)
        budget, persistent = k.model_persistence_threshold // n, 0
        for x in (*trainable, *frozen):
            if x <= k.param_persistence_threshold and persistent + x <= budget:
                persistent += _ceil_to(x, n)
        params = shards + sum(-(-x // n) for x in frozen) + persistent
        chunk = min(shards, k.sub_group_size)
        return [RankStates(params, persistent, shards, shards, chunk)] * n
    flat = _ceil_to(total, 2 * n)
    part = flat // n
    if setup.stage < 2:
        return [RankStates(flat + frozen_total, 0, total, part, part)] * n
    out = []
    for rank in range(n):
        lo, hi, offset, touching = rank * part, (rank + 1) * part, 0, 0
        for x in trainable:
            if offset < hi and offset + x > lo:
                touching += x
            offset += x
        out.append(RankStates(flat + frozen_total, 0, touching, part, part))
    return out


# ----------------------------------------------------------------------------------------- activations


def _norm(width: int, fp32: bool = False) -> int:
    """HF RMSNorm keeps its fp32 upcast input (4 B) and the normalised bf16 tensor (2 B) for backward. In 16-bit
    units (``activation_bytes`` doubles fp32): an fp32 model's upcast is a no-op, so it keeps 4 + 4 B = 4w units."""
    return (4 if fp32 else 6) * width


def _attention_per_token(a: Arch, setup: Setup) -> int:
    """Bytes saved per token by one attention block (16-bit tensors, fp32 softmax statistics)."""
    if a.kv_lora_rank:  # MLA: q via q_a/q_b (or q_proj), k/v via the compressed kv_a -> kv_b path
        qk = a.heads * (a.qk_nope_dim + a.qk_rope_dim)
        v = a.heads * a.v_head_dim
        fp32 = setup.precision == "fp32"
        q_path = _norm(a.q_lora_rank, fp32) + 2 * a.q_lora_rank if a.q_lora_rank else 0
        kv_path = _norm(a.kv_lora_rank, fp32) + 2 * a.kv_lora_rank
        body = 2 * a.hidden + q_path + kv_path + 2 * qk + 2 * qk + 2 * v
        out = v
    else:  # MHA/GQA: q, k, v after RoPE are what the attention kernel saves
        body = 2 * a.hidden + 2 * a.heads * a.head_dim + 4 * a.kv_heads * a.head_dim
        out = a.heads * a.head_dim
    body += 2 * out + 4 * a.heads + 2 * out  # kernel output, its fp32 logsumexp, o_proj input
    if setup.attention == "eager":  # fp32 softmax output, bf16 probabilities, dropout mask: 7·heads·s per token
        body += 7 * a.heads * setup.seq_len
    return body


def _mlp_per_token(a: Arch, moe: bool, tiled: bool = False, fp32: bool = False) -> int:
    """SwiGLU: input 2h, gate output 2i (SiLU input), SiLU output 2i, up output 2i, down input 2i. ``tiled``
    (TiledMLP): the dense MLP and the shared experts save only their input; one tile's 8i is ``mlp_tile_bytes``."""
    if not moe:
        return 2 * a.hidden + (0 if tiled else 8 * a.intermediate)
    k = a.experts_per_token
    # fp32 router input and sigmoid/softmax scores; an fp32 model's input upcast is the MLP input itself
    router = 2 * a.experts if fp32 else 4 * a.hidden + 4 * a.experts
    routed = k * (4 * a.hidden + 8 * a.moe_intermediate)  # each token's copy per chosen expert, in and out
    shared = 2 * a.hidden if tiled else 8 * a.shared_intermediate
    return 2 * a.hidden + router + routed + shared


def mlp_tile_bytes(stats: ModelStats, setup: Setup) -> int:
    """16-bit bytes of one MLP tile recomputed in backward under TiledMLP (0 untiled): its intermediates (8i per
    token), its input gradient buffer (zeros of the whole input, 2h per token) and the tile's output gradient."""
    a, tokens = stats.arch, setup.tokens
    tiles = setup.savers.mlp_tiles(a, setup.seq_len // setup.sequence_parallel)
    if tiles <= 1:
        return 0
    tile = -(-tokens // tiles)
    width = max(a.intermediate if len(stats.moe_mask) != sum(stats.moe_mask) else 0, a.shared_intermediate)
    return tile * (8 * width + 2 * a.hidden) + 2 * a.hidden * tokens


def layer_activation_bytes(stats: ModelStats, setup: Setup) -> list[int]:
    """Saved activations of each decoder layer for one micro-batch, in 16-bit (``activation_bytes`` scales fp32)."""
    a, tokens = stats.arch, setup.tokens
    lora = 2 * setup.lora_rank * len(stats.lora_shapes) // max(a.layers, 1) if setup.lora_rank else 0
    fp32 = setup.precision == "fp32"
    common = 2 * _norm(a.hidden, fp32) + _attention_per_token(a, setup) + lora
    tiled = setup.savers.mlp_tiles(a, setup.seq_len) > 1
    dense = common + _mlp_per_token(a, moe=False, tiled=tiled)
    moe = common + _mlp_per_token(a, moe=True, tiled=tiled, fp32=fp32)
    router_weight = 0 if fp32 else 4 * a.experts * a.hidden  # fp32 copy of the router weight, saved per MoE layer
    mask = stats.moe_mask or (False,) * (a.layers - a.moe_layers) + (True,) * a.moe_layers
    gathered = gathered_kv_bytes(stats, setup)
    return [(moe * tokens + router_weight if is_moe else dense * tokens) + gathered for is_moe in mask]


def gathered_kv_bytes(stats: ModelStats, setup: Setup) -> int:
    """Sequence parallelism: the whole rows' keys and values one layer all-gathers and its attention keeps for
    backward, 16-bit (``sequence_parallel.gathered_bytes`` plus this rank's own slice); 0 without it."""
    if setup.sequence_parallel <= 1:
        return 0
    a = stats.arch
    mla = a.heads * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)  # every head's expanded key and value
    width = mla if a.kv_lora_rank else 2 * a.kv_heads * a.head_dim
    return 2 * width * setup.micro_batch * setup.seq_len


def sequence_mask_bytes(setup: Setup) -> int:
    """Sequence parallelism: one attention chunk's causal + document mask (bool, and sdpa's float copy in the
    training dtype), rebuilt per chunk and freed (``sequence_parallel.MASK_ELEMENTS`` bounds it); 0 without it."""
    if setup.sequence_parallel <= 1:
        return 0
    piece = setup.seq_len // (2 * setup.sequence_parallel)  # a chunk's queries lie in one of the rank's two pieces
    elements = min(MASK_ELEMENTS, setup.micro_batch * piece * setup.seq_len)
    return elements * (1 + (4 if setup.precision == "fp32" else 2))


def activation_bytes(
    stats: ModelStats,
    setup: Setup,
    layers: range | None = None,
    head: bool = True,
    in_flight: int = 1,
    interval: int | None = None,
) -> int:
    """Saved activations of one micro-batch (Korthikanti et al. 2022, adapted: no dropout, SwiGLU, MLA, MoE).

    ``layers`` (default all) and ``head`` (final norm + lm_head input) say what this rank or card holds;
    ``in_flight`` micro-batches keep theirs at once (a pipeline stage); checkpointing every ``interval`` layers
    (default: 1 when ``setup.checkpointing``) keeps each chunk's input and recomputes one chunk at a time; with
    ``setup.savers.offload`` those inputs live in host memory (``offloaded_bytes``) and the card holds the one being
    recomputed. A tiled MLP adds one tile's recompute (``mlp_tile_bytes``).
    """
    a, tokens = stats.arch, setup.tokens
    per_layer = layer_activation_bytes(stats, setup)
    held = [per_layer[i] for i in (layers if layers is not None else range(len(per_layer)))]
    interval = (1 if setup.checkpointing else 0) if interval is None else interval
    if interval and held:  # only each chunk's input survives; one chunk is recomputed at a time
        chunks = 1 if setup.savers.offload else in_flight * -(-len(held) // interval)
        body = chunks * 2 * a.hidden * tokens + sum(sorted(held)[-interval:])
    else:
        body = in_flight * sum(held)
    body += mlp_tile_bytes(stats, setup) if held else 0
    final = (_norm(a.hidden, setup.precision == "fp32") + 2 * a.hidden) * tokens if head else 0  # + lm_head input
    scale = 2 if setup.precision == "fp32" else 1
    return scale * (body + final) + sequence_mask_bytes(setup)


def offloaded_bytes(stats: ModelStats, setup: Setup) -> int:
    """Host bytes of one rank's checkpointed layer inputs under ``savers.offload`` (16-bit [tokens × hidden] per
    layer; 0 without checkpointing or offload)."""
    if not (setup.savers.offload and setup.checkpointing):
        return 0
    a = stats.arch
    return setup.bytes_per_value * a.layers * a.hidden * setup.tokens


def logits_bytes(stats: ModelStats, setup: Setup) -> int:
    """The loss's working set over the LM head.

    Untiled: 16-bit logits (2) + fp32 log-softmax kept for the loss (4) + two fp32 gradients in its backward (8)
    per [tokens × vocab] value; in fp32 the logits are freed after the forward: 12 (measured on the CPU,
    bench/long_context.py). Tiled (``savers.loss_tiles``): the same per value of one tile of ceil(tokens /
    tiles) rows (never fewer than 256), plus the fp32 grad_weight buffer [V × H] (in 16-bit also each tile's
    [V × H] matmul output and its fp32 upcast; fp32 accumulates in place), the per-token fp32 log-sum-exp and the
    [tokens × hidden] hidden-state gradient.
    """
    a, tokens, p = stats.arch, setup.tokens, setup.bytes_per_value
    per_value = 14 if p == 2 else 12
    if not setup.savers.loss_tiles:
        return per_value * tokens * a.vocab
    rows = max(-(-tokens // setup.savers.loss_tiles), min(tokens, MIN_TILE_ROWS))  # losses.tiled.TiledLoss.tile_rows
    grad_weight = (10 if p == 2 else 4) * a.vocab * a.hidden  # 16-bit: + each tile's product and its fp32 upcast
    return per_value * rows * a.vocab + grad_weight + 4 * tokens + p * tokens * a.hidden


# -------------------------------------------------------------------------------------------- estimate


@dataclass(frozen=True)
class Estimate:
    """Bytes per card (the busiest rank) and host RAM for the whole machine."""

    setup: Setup
    params: int
    grads: int
    optimizer: int
    """fp32 master weights + Adam m and v kept on the card (0 when offloaded)."""
    activations: int
    logits: int
    buffers: int
    """DeepSpeed's reduce buckets, and under ZeRO-3 the gathered parameters/gradients of the live modules."""
    step: int
    """fp32 gradient partition made during optimizer.step (activations are freed by then)."""
    other: int
    """CUDA context/NCCL and allocator fragmentation: on the card, outside max_memory_allocated."""
    host: int
    host_states: int
    """Offloaded optimizer/parameter bytes of all ranks (pinned host memory for the whole run)."""
    host_load: int
    """Transient host bytes while the ranks build the model (``host`` counts the larger of the two)."""
    trainable: int
    where: str = "every rank"
    """The busiest holder these bytes are for: every rank (ZeRO), a pipeline stage, a card of the layer split."""

    @property
    def allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: states + the larger of backward and step working sets."""
        states = self.params + self.grads + self.optimizer
        return states + max(self.activations + self.logits + self.buffers, self.step)

    @property
    def gpu_total(self) -> int:
        return self.allocated + self.other

    def fits(self, gpu_mem: float, cpu_mem: float | None = None) -> bool:
        """Whether the card (and host, if given) has room; memory in bytes."""
        return self.gpu_total <= gpu_mem and (cpu_mem is None or self.host <= cpu_mem)


@dataclass(frozen=True)
class Share:
    """What one rank (or card) of a layout holds: its parameters, its decoder layers, whether it computes the
    logits, and how many micro-batches keep their activations on it at once."""

    where: str
    trainable: tuple[int, ...]
    frozen: tuple[int, ...]
    layers: range
    head: bool
    in_flight: int = 1


def pipeline_parts(stats: ModelStats, layout: PipelineLayout) -> list[int]:
    """Cut points over [embedding, decoder × L, head], computed as DeepSpeed's ``PipelineModule`` does."""
    from deepspeed.runtime import utils as ds_utils

    units = list(stats.stage_numels)
    method = layout.partition.lower()
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(units), num_parts=layout.stages)
    if method.startswith("type:"):
        units = [0] + [1] * (len(units) - 2) + [0]  # only DecoderStage layers are counted
    return ds_utils.partition_balanced(weights=units, num_parts=layout.stages)


def shares(stats: ModelStats, setup: Setup) -> list[Share]:
    """What each rank or card of ``setup.layout`` holds (ZeRO: one share, the same on every rank)."""
    layout, layers = setup.layout, stats.arch.layers
    units = stats.stage_numels
    if isinstance(layout, PipelineLayout):
        parts, out = pipeline_parts(stats, layout), []
        for stage in range(layout.stages):
            lo, hi = parts[stage], parts[stage + 1]
            held = range(max(lo, 1) - 1, min(hi, layers + 1) - 1)
            in_flight = min(layout.stages - stage, setup.accum)  # 1F1B: forwards before the first backward
            out.append(Share(f"pipeline stage {stage}", tuple(units[lo:hi]), (), held, hi == layers + 2, in_flight))
        return out
    if isinstance(layout, LayerSplitLayout):
        cuts, last = layout.cuts, layout.cards - 1
        return [
            Share(
                f"card {k}",
                (units[0],) * (k == 0) + tuple(units[1 + cuts[k] : 1 + cuts[k + 1]]) + (units[-1],) * (k == last),
                (),
                range(cuts[k], cuts[k + 1]),
                k == last,
            )
            for k in range(layout.cards)
        ]
    if setup.lora_rank:
        return [Share("every rank", stats.lora_numels(setup.lora_rank), stats.param_numels, range(layers), True)]
    return [Share("every rank", stats.param_numels, (), range(layers), True)]


def _states(stats: ModelStats, setup: Setup, share: Share) -> tuple[int, int, int, int, int, RankStates]:
    """(params, grads, optimizer, step, buffers) bytes of one share on its card, and its ZeRO layout."""
    p, k = setup.bytes_per_value, setup.zero
    ranks = rank_states(share.trainable, share.frozen, setup)
    rs = max(ranks, key=lambda r: r.params + r.grads)
    total = sum(share.trainable)
    if isinstance(setup.layout, LayerSplitLayout):  # torch AdamW on fp32 masters (the weights themselves in fp32)
        master = 4 if p == 2 else 0
        return p * total, p * total, (8 + master) * total, master * total, 0, rs
    if isinstance(setup.layout, PipelineLayout):
        n = setup.dp_size
        grad_bytes = 4 if setup.layout.fp32_grad_accum or p == 4 else p
        buffers = grad_bytes * min(k.reduce_bucket_size, total) if n > 1 else 0  # the engine's gradient all-reduce
        if setup.precision == "bf16" and (setup.layout.fp32_grad_accum or setup.stage == 0):
            # DeepSpeed's BF16_Optimizer: fp32 master + m + v partitioned, gradients one whole buffer of the stage
            return p * rs.params, grad_bytes * total, ADAM_K * _ceil_to(total, 2 * n) // n, 0, buffers, rs
        return p * rs.params, grad_bytes * rs.grads, ADAM_K * rs.optimizer, 4 * rs.step_chunk, buffers, rs
    off_opt, off_par = setup.offload_optimizer, setup.offload_params
    params = p * (rs.persistent if off_par else rs.params)
    grads = 0 if off_opt and setup.stage >= 2 else p * rs.grads
    optimizer = 0 if off_opt else ADAM_K * rs.optimizer
    step = 0 if off_opt else 4 * rs.step_chunk
    overlap = k.overlap_comm if k.overlap_comm is not None else setup.stage == 3
    if setup.stage == 3:
        largest = stats.largest_module
        gathered = min(k.max_live_parameters, largest + k.prefetch_bucket_size)
        buffers = p * (k.reduce_bucket_size + gathered + largest)
    elif setup.stage > 0:
        buffers = p * k.reduce_bucket_size * (2 if overlap else 1)
    else:
        buffers = 0
    return params, grads, optimizer, step, buffers, rs


def host_bytes(stats: ModelStats, setup: Setup, rs: RankStates) -> tuple[int, int, int]:
    """(host RAM of the machine, offloaded states, transient load bytes): pretrained weights load in the training
    dtype, a random-init model is built in fp32; every process builds the whole model except under ZeRO-3."""
    p, n = setup.bytes_per_value, setup.world_size
    procs = 1 if isinstance(setup.layout, LayerSplitLayout) else n
    host_states = 0
    if setup.offload_optimizer:  # fp32 master + m + v, fp32 gradient partition, 16-bit staging buffer, per rank
        host_states += n * (ADAM_K + 4 + p) * rs.optimizer
    if setup.offload_params:
        host_states += n * p * (rs.params - rs.persistent)
    host_states += procs * offloaded_bytes(stats, setup)
    load_bytes = p if setup.pretrained else 4
    zero3 = setup.layout is None and setup.stage == 3  # partitions module by module while loading
    load = procs * load_bytes * (stats.largest_module if zero3 else stats.total)
    return procs * HOST_PER_RANK + max(load, host_states), host_states, load


def estimate(stats: ModelStats, setup: Setup) -> Estimate:
    """Per-card memory of the busiest rank or card of one setup, and host memory (formulas in docs/memory.md)."""
    interval = setup.layout.checkpoint_interval if isinstance(setup.layout, PipelineLayout) else None
    if isinstance(setup.layout, LayerSplitLayout):
        interval = 0  # the layer split engine never turns on gradient checkpointing
    out = []
    for share in shares(stats, setup):
        params, grads, optimizer, step, buffers, rs = _states(stats, setup, share)
        activations = activation_bytes(stats, setup, share.layers, share.head, share.in_flight, interval)
        logits = logits_bytes(stats, setup) if share.head else 0
        allocated = params + grads + optimizer + max(activations + logits + buffers, step)
        other = CUDA_RESERVE + int(FRAGMENTATION * allocated)
        host, host_states, load = host_bytes(stats, setup, rs)
        out.append(
            Estimate(
                setup,
                params,
                grads,
                optimizer,
                activations,
                logits,
                buffers,
                step,
                other,
                host,
                host_states,
                load,
                sum(share.trainable),
                share.where,
            )
        )
    return max(out, key=lambda e: e.gpu_total)


def max_micro_batch(stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None = None) -> int:
    """Largest micro-batch (1..64) that fits; 0 if even 1 does not (memory grows with the batch: bisect)."""
    lo, hi = 0, MAX_MICRO_BATCH
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(stats, replace(setup, micro_batch=mid)).fits(gpu_mem, cpu_mem):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _micro1_setup(
    ds: dict[str, Any],
    stats: ModelStats,
    world_size: int,
    seq_len: int,
    checkpointing: bool,
    lora_rank: int,
    pretrained: bool,
    savers: SaverTerms,
) -> Setup:
    """A preset's Setup at micro-batch 1 (what ``recommend`` and the longest-sequence search start from)."""
    return setup_from_ds_config(
        ds,
        world_size=world_size,
        seq_len=seq_len,
        hidden_size=stats.arch.hidden,
        checkpointing=checkpointing,
        lora_rank=lora_rank,
        micro_batch=1,
        pretrained=pretrained,
        savers=savers,
    )


@dataclass(frozen=True)
class Recommendation:
    preset: str
    setup: Setup
    micro_batch: int
    estimate: Estimate


def recommend(
    stats: ModelStats,
    world_size: int,
    seq_len: int,
    gpu_mem: float,
    cpu_mem: float | None,
    lora_rank: int = 0,
    presets: Sequence[str] = PRESET_ORDER,
    pretrained: bool = True,
    savers: SaverTerms | None = None,
    min_micro: int = 1,
) -> Recommendation | None:
    """First preset (fastest first) that fits at micro-batch ``min_micro`` (a preference pair: 2 sequences),
    preferring no activation checkpointing; ``savers`` None = train.py's defaults (the tiled loss)."""
    savers = SaverTerms.choose(stats.arch) if savers is None else savers
    for name in presets:
        ds = load_preset(name)
        for ckpt in (False, True):
            setup = _micro1_setup(ds, stats, world_size, seq_len, ckpt, lora_rank, pretrained, savers)
            mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem) // min_micro * min_micro
            if mb:
                setup = replace(setup, micro_batch=mb)
                return Recommendation(name, setup, mb, estimate(stats, setup))
    return None


# ------------------------------------------------------------------------------------ longest sequence


SAVER_CHOICES: tuple[tuple[bool, bool, bool], ...] = (
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, True, False),
    (True, False, True),
    (True, True, True),
)
"""(activation checkpointing, offloaded checkpoints, tiled MLP) the longest-sequence search tries, cheapest first."""


@dataclass(frozen=True)
class LongestSeq:
    """The longest sequence one setup trains at micro-batch 1, and what it needs there."""

    seq_len: int
    preset: str
    setup: Setup
    estimate: Estimate

    def label(self) -> str:
        s, parts = self.setup, [f"`{self.preset}`"]
        parts += [f"SP {s.sequence_parallel}"] * (s.sequence_parallel > 1)
        parts += ["ckpt"] * s.checkpointing + ["offload"] * (s.checkpointing and s.savers.offload)
        return " + ".join(parts + ["tiled MLP"] * s.savers.tiled_mlp + ["untiled loss"] * (not s.savers.loss_tiles))


def longest_seq_len(
    stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, step: int = SEQ_STEP
) -> int:
    """Longest multiple of ``step`` (up to ``MAX_SEQ_SEARCH``) at which ``setup`` fits; 0 if ``step`` does not
    (memory grows with the sequence: bisect)."""
    lo, hi = 0, MAX_SEQ_SEARCH // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(stats, replace(setup, seq_len=mid * step)).fits(gpu_mem, cpu_mem):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def longest_sequences(
    stats: ModelStats,
    world_size: int,
    gpu_mem: float,
    cpu_mem: float | None,
    lora_rank: int = 0,
    pretrained: bool = True,
    tiled_loss: bool = True,
    choices: Sequence[tuple[bool, bool, bool]] = SAVER_CHOICES,
    sequence_parallel: bool = True,
) -> list[LongestSeq]:
    """The longest sequence of every preset × ``choices`` (checkpointing, offload, tiled MLP) at micro-batch 1,
    each also split over all ranks (sequence parallelism, ZeRO presets) when ``sequence_parallel``."""
    out = []
    for name in PRESET_ORDER:
        ds = load_preset(name)
        for ckpt, offload, mlp in choices:
            savers = SaverTerms.choose(stats.arch, tiled_loss, offload, mlp)
            base = _micro1_setup(ds, stats, world_size, SEQ_STEP, ckpt, lora_rank, pretrained, savers)
            splits = (1, world_size) if sequence_parallel and base.layout is None and world_size > 1 else (1,)
            for split in splits:
                setup = replace(base, sequence_parallel=split)
                n = longest_seq_len(stats, setup, gpu_mem, cpu_mem)
                setup = replace(setup, seq_len=max(n, SEQ_STEP))
                out.append(LongestSeq(n, name, setup, estimate(stats, setup)))
    return out


def longest_sequence(
    stats: ModelStats, world_size: int, gpu_mem: float, cpu_mem: float | None, **kw: Any
) -> LongestSeq | None:
    """The setup that trains the longest sequence (the first, fastest, of equals); None if none trains ``SEQ_STEP``."""
    best = max(longest_sequences(stats, world_size, gpu_mem, cpu_mem, **kw), key=lambda r: r.seq_len)
    return best if best.seq_len else None


def _seq_cell(best: LongestSeq | None, arch: Arch) -> str:
    if best is None:
        return f"under {SEQ_STEP:,}"
    n = f"≥ {best.seq_len:,}" if best.seq_len >= MAX_SEQ_SEARCH else f"{best.seq_len:,}"
    context = f"; over the {arch.max_positions:,} context" if best.seq_len > arch.max_positions > 0 else ""
    return f"{n} ({best.label()}{context})"


def render_longest(
    stats: ModelStats, world_size: int, gpu_mem_gb: float, cpu_mem_gb: float, lora_rank: int, **kw: Any
) -> str:
    """``--max-seq-len``: the longest sequence of every preset and saver choice, full and LoRA, and the limit."""
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    full = longest_sequences(stats, world_size, gpu_mem, cpu_mem, **kw)
    lora = longest_sequences(stats, world_size, gpu_mem, cpu_mem, lora_rank=lora_rank, **kw)
    lines = [
        f"{stats.name}: longest sequence at micro-batch 1 on {world_size} × {gpu_mem_gb:g} GiB, host {cpu_mem_gb:g} "
        f"GiB (multiples of {SEQ_STEP}; model context {stats.arch.max_positions:,})",
        "",
    ]
    rows = [
        [
            r.preset,
            str(r.setup.sequence_parallel),
            "on" if r.setup.checkpointing else "off",
            "on" if r.setup.savers.offload else "off",
            "on" if r.setup.savers.tiled_mlp else "off",
            f"{r.seq_len:,}",
            f"{q.seq_len:,}",
        ]
        for r, q in zip(full, lora, strict=True)
    ]
    headers = ["preset", "SP", "ckpt", "offload", "tiled MLP", "full", f"LoRA r{lora_rank}"]
    lines += [format_table(headers, rows, [False] * 5 + [True] * 2), ""]
    for what, runs in (("full fine-tuning", full), (f"LoRA r{lora_rank}", lora)):
        best = max(runs, key=lambda r: r.seq_len)
        if not best.seq_len:
            lines.append(f"Longest for {what}: nothing trains {SEQ_STEP} tokens.")
            continue
        over = estimate(stats, replace(best.setup, seq_len=best.seq_len + SEQ_STEP))
        lines.append(
            f"Longest for {what}: {_seq_cell(best, stats.arch)}; at {over.setup.seq_len:,}: {_breakdown(over)}"
        )
    return "\n".join(lines)


def _breakdown(e: Estimate) -> str:
    return (
        f"GPU {_gib(e.gpu_total)} GiB (params {_gib(e.params)}, grads {_gib(e.grads)}, optimizer {_gib(e.optimizer)}, "
        f"activations {_gib(e.activations)}, logits {_gib(e.logits)}, buffers {_gib(e.buffers)}, step {_gib(e.step)}, "
        f"CUDA+fragmentation {_gib(e.other)}), host {_gib(e.host)} GiB"
    )


# ------------------------------------------------------------------------------------------ the table


TABLE_ROWS: tuple[tuple[int, bool, bool, str], ...] = (
    (1, False, False, "zero2_bf16"),
    (1, True, False, "zero2_offload"),
    (2, False, False, "zero2_bf16"),
    (2, True, False, "zero2_offload"),
    (3, False, False, "zero3"),
    (3, True, False, "zero3_offload"),
    (3, True, True, "zero3_offload"),
)
"""(stage, offload optimizer, offload params, preset whose bucket sizes the row uses)."""


def table_setups(
    stats: ModelStats,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    lora_rank: int,
    pretrained: bool = True,
    savers: SaverTerms | None = None,
) -> list[Setup]:
    """Every stage × offload × {full, LoRA} × {checkpointing off, on} combination."""
    out = []
    for stage, opt, par, preset in TABLE_ROWS:
        ds = load_preset(preset)
        zero = {**ds.get("zero_optimization", {}), "stage": stage}
        zero["offload_optimizer"] = {"device": "cpu" if opt else "none"}
        zero["offload_param"] = {"device": "cpu" if par else "none"}
        ds = {**ds, "zero_optimization": zero, "bf16": {"enabled": True}}
        for lora in (0, lora_rank):
            for ckpt in (False, True):
                out.append(
                    setup_from_ds_config(
                        ds,
                        world_size=world_size,
                        seq_len=seq_len,
                        hidden_size=stats.arch.hidden,
                        checkpointing=ckpt,
                        lora_rank=lora,
                        micro_batch=micro_batch,
                        pretrained=pretrained,
                        savers=SaverTerms.choose(stats.arch) if savers is None else savers,
                    )
                )
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """Plain-text table, columns as wide as their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)]).rstrip()


def render(stats: ModelStats, world_size: int, gpu_mem_gb: float, cpu_mem_gb: float, seq_len: int, **kw: Any) -> str:
    """The planner's full report: model summary, table, recommendation."""
    micro_batch, lora_rank = kw.get("micro_batch", 1), kw.get("lora_rank", LORA_RANK)
    pretrained = kw.get("pretrained", True)
    savers = kw.get("savers") or SaverTerms.choose(stats.arch)
    pair_rows = kw.get("pair_rows", 1)  # sequences per sample: a preference pair is 2 (recommend whole pairs)
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    a = stats.arch
    moe = f", MoE {a.moe_layers}/{a.layers} layers, {a.experts_per_token} of {a.experts} experts" if a.experts else ""
    mla = f", MLA (kv rank {a.kv_lora_rank})" if a.kv_lora_rank else ""
    lines = [
        f"{stats.name}: {_count(stats.total)} params ({_count(stats.active)} active per token, "
        f"{_count(stats.embedding)} embedding+lm_head), {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}{mla}{moe}",
        f"{world_size} GPUs × {gpu_mem_gb:g} GiB, host RAM {cpu_mem_gb:g} GiB, seq len {seq_len}, micro-batch "
        f"{micro_batch}, LoRA rank {lora_rank} on {len(stats.lora_shapes)} linears "
        f"({_count(sum(stats.lora_numels(lora_rank)))} trainable). Memory savers: {savers.label()} (offload: "
        "checkpointed rows only).",
        "GiB per card (busiest rank); bf16 and fp16 hold the same bytes (16-bit weights/grads/activations, fp32 "
        "master + Adam m, v), so each row is both.",
        "",
    ]
    headers = ["ZeRO", "offload", "train", "ckpt", "params", "grads", "optim", "activ", "logits", "buffers"]
    headers += ["GPU", "host", "fits", "max mb"]
    rows = []
    for setup in table_setups(stats, world_size, seq_len, micro_batch, lora_rank, pretrained, savers):
        e = estimate(stats, setup)
        gpu_ok, host_ok = e.gpu_total <= gpu_mem, e.host <= cpu_mem
        mark = "✓" if gpu_ok and host_ok else "✗ GPU" if not gpu_ok else "✗ host"
        mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem)
        off = "+".join(w for w, on in (("opt", setup.offload_optimizer), ("param", setup.offload_params)) if on)
        rows.append(
            [
                str(setup.stage),
                off or "-",
                f"LoRA r{setup.lora_rank}" if setup.lora_rank else "full",
                "on" if setup.checkpointing else "off",
                *(_gib(x) for x in (e.params, e.grads, e.optimizer, e.activations, e.logits, e.buffers)),
                _gib(e.gpu_total),
                _gib(e.host),
                mark,
                (f"{mb}+" if mb == MAX_MICRO_BATCH else str(mb)) if mb else "-",
            ]
        )
    right = [False] * 4 + [True] * 8 + [False, True]
    lines.append(format_table(headers, rows, right))
    lines += [
        "",
        "optim = fp32 master + Adam m, v. GPU = params + grads + optim + max(activ + logits + buffers, fp32 gradient "
        f"copy made by the step) + {_gib(CUDA_RESERVE)} GiB CUDA/NCCL + {FRAGMENTATION:.0%} fragmentation. "
        f"host = whole machine ({'pretrained weights load in the training dtype' if pretrained else 'random init: built in fp32'}). max mb = largest micro-batch that fits.",
    ]
    for what, rank in (("full fine-tuning", 0), (f"LoRA r{lora_rank}", lora_rank)):
        rec = recommend(
            stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=rank, pretrained=pretrained, savers=savers,
            min_micro=pair_rows,
        )  # fmt: skip
        lines.append(_recommendation_line(what, rec, gpu_mem_gb, pair_rows))
    return "\n".join(lines)


def _recommendation_line(what: str, rec: Recommendation | None, gpu_mem_gb: float, pair_rows: int = 1) -> str:
    if rec is None:
        unit = " at one pair per micro-batch" if pair_rows > 1 else ""
        return f"Recommended for {what}: nothing fits{unit}, not even ZeRO-3 with parameter and optimizer offload."
    ckpt = "on" if rec.setup.checkpointing else "off"
    alt = " (or zero2 for fp16)" if rec.preset == "zero2_bf16" else ""
    pairs = rec.micro_batch // pair_rows
    micro = f"{pairs} pair{'s' * (pairs != 1)}" if pair_rows > 1 else str(rec.micro_batch)
    return (
        f"Recommended for {what}: ds_configs/{rec.preset}.json{alt}, activation checkpointing {ckpt}, "
        f"micro-batch {micro} (peak {_gib(rec.estimate.gpu_total)} of {gpu_mem_gb:g} GiB per card, "
        f"host {_gib(rec.estimate.host)} GiB)."
    )


def _fit_cell(rec: Recommendation | None, full: bool) -> str:
    if rec is None:
        return "does not fit"
    ckpt = " + checkpointing" if rec.setup.checkpointing else ""
    where = f"{_gib(rec.estimate.gpu_total)} GiB/card, host {_gib(rec.estimate.host)} GiB" if full else ""
    return f"`{rec.preset}`{ckpt}, micro {rec.micro_batch}" + (f" ({where})" if where else "")


def fit_table(world_size: int, gpu_mem_gb: float, cpu_mem_gb: float, seq_len: int, lora_rank: int = LORA_RANK) -> str:
    """README's "which preset fits" table: one row per preset naming a checkpoint, from ``recommend``."""
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    box = f"{world_size}× {gpu_mem_gb:g} GB"
    rows = [
        f"| model | full fine-tune | LoRA r{lora_rank} | longest sequence on {box}, full | "
        f"longest sequence on {box}, LoRA r{lora_rank} |",
        "|---|---|---|---|---|",
    ]
    for name, preset in PRESETS.items():
        if preset.hub_id is None:
            continue
        stats = model_stats(preset.config(), name)
        full = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem)
        lora = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=lora_rank)
        longest = [
            _seq_cell(longest_sequence(stats, world_size, gpu_mem, cpu_mem, lora_rank=rank), stats.arch)
            for rank in (0, lora_rank)
        ]
        rows.append(f"| {name} | {_fit_cell(full, True)} | {_fit_cell(lora, False)} | {' | '.join(longest)} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------- train.py hook


def detected_gpu_mem_gb() -> float | None:
    """Smallest visible CUDA card in GiB, or None when the ranks do not train on CUDA."""
    from deepzero.distributed import on_cuda

    if not on_cuda():
        return None
    sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return min(sizes) / GiB


def detected_cpu_mem_gb() -> float | None:
    """Physical host RAM in GiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


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
    engine: EngineSettings,
    cfg: ResolvedConfig,
    seq_len: int,
    world_size: int,
    pretrained: bool,
    savers: SaverTerms | None = None,
) -> Setup:
    """The Setup a run trains with, from what its RunPlan decided: the engine settings (layout, LoRA, gradient
    checkpointing), the resolved config's precision and batch, pretrained or random init, the memory savers
    (``SaverTerms.of(plan.savers)``; None: none). ``cfg.ds`` is read only for the ZeRO sizes DeepSpeed is given."""
    from deepzero.engines import LayerSplitSettings, PipelineSettings, ZeroSettings
    from deepzero.engines.layer_split import parse_devices

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
    if isinstance(engine, ZeroSettings):
        return replace(
            base,
            checkpointing=engine.gradient_checkpointing,
            lora_rank=engine.lora.r if engine.lora else 0,
            sequence_parallel=getattr(engine, "sequence_parallel", 1),
        )
    if isinstance(engine, PipelineSettings):
        accum_dtype = cfg.ds.get("data_types", {}).get("grad_accum_dtype")
        interval = engine.activation_checkpoint_interval
        layout = PipelineLayout(engine.stages, engine.partition, interval, fp32_grad_accum=accum_dtype == "fp32")
        return replace(base, layout=layout, checkpointing=interval > 0)
    if isinstance(engine, LayerSplitSettings):
        cuts = layer_split_cuts(config, parse_devices(engine.devices), seq_len, cfg.batch.micro)
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


def check_fit(
    model_config: PretrainedConfig,
    engine: EngineSettings,
    cfg: ResolvedConfig,
    seq_len: int,
    *,
    world_size: int,
    pretrained: bool,
    gpu_mem_gb: float | None = None,
    cpu_mem_gb: float | None = None,
    savers: SaverTerms | None = None,
    rows_per_sample: int = 1,
) -> str | None:
    """A one-line warning when the planned run will not fit the cards (or host RAM), else None.

    Plans what the engine will hold (``run_setup``); a preference pair is ``rows_per_sample`` = 2 sequences per
    sample (the reference model is never on the cards: its log-probs are precomputed, or it is the same model
    with the LoRA adapters off). Call before loading weights. ``gpu_mem_gb`` None = detect
    the smallest visible card; without CUDA there is nothing to check and the answer is None. ``cpu_mem_gb``
    None = detect the machine's RAM.
    """
    if gpu_mem_gb is None:
        gpu_mem_gb = detected_gpu_mem_gb()
        if gpu_mem_gb is None:
            return None
    if cpu_mem_gb is None:
        cpu_mem_gb = detected_cpu_mem_gb()
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB if cpu_mem_gb else None
    try:
        setup = run_setup(model_config, engine, cfg, seq_len, world_size, pretrained, savers)
        setup = replace(setup, micro_batch=setup.micro_batch * rows_per_sample)
        name = getattr(model_config, "name_or_path", "") or "model"
        stats = model_stats(model_config, name, lora=getattr(engine, "lora", None))
    except UserError:
        return None  # e.g. a layer split over every GPU with none visible: the engine reports it itself
    except (ValueError, KeyError, AttributeError) as err:  # e.g. a remote-code architecture
        return f"memory plan skipped: cannot build {model_config.model_type} on the meta device ({err})"
    est = estimate(stats, setup)
    if est.fits(gpu_mem, cpu_mem):
        return None
    shortfall = _shortfall(est, gpu_mem_gb, cpu_mem_gb, rows_per_sample)
    return f"{shortfall}; {_advice(stats, setup, gpu_mem, cpu_mem, rows_per_sample)}"


def _micro_text(sequences: int, rows_per_sample: int) -> str:
    """A micro-batch as the user sets it: sequences, or pairs of them for a preference run."""
    if rows_per_sample == 1:
        return str(sequences)
    pairs = sequences // rows_per_sample
    return f"{pairs} pair{'s' * (pairs != 1)} ({sequences} sequences)"


def _shortfall(est: Estimate, gpu_mem_gb: float, cpu_mem_gb: float | None, rows_per_sample: int = 1) -> str:
    setup = est.setup
    if est.gpu_total > gpu_mem_gb * GiB:
        return (
            f"memory plan: {setup.label()} at micro-batch {_micro_text(setup.micro_batch, rows_per_sample)}, seq"
            f" {setup.seq_len} needs "
            f"~{_gib(est.gpu_total)} GiB per GPU ({est.where}: params {_gib(est.params)}, grads {_gib(est.grads)}, "
            f"optimizer {_gib(est.optimizer)}, activations {_gib(est.activations)}, logits {_gib(est.logits)}, "
            f"buffers {_gib(est.buffers)}) but the cards have {gpu_mem_gb:.1f} GiB"
        )
    load = "pretrained weights" if setup.pretrained else "fp32 random-init models"
    what = "offloaded states" if est.host_states >= est.host_load else f"{load} while loading"
    procs = "1 process" if isinstance(setup.layout, LayerSplitLayout) else f"{setup.world_size} ranks"
    return (
        f"memory plan: {setup.label()} needs ~{_gib(est.host)} GiB of host RAM for {procs} "
        f"({_gib(max(est.host_states, est.host_load))} of it {what}) but the machine has {cpu_mem_gb:.0f} GiB"
    )


def _advice(stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, rows_per_sample: int = 1) -> str:
    """What would fit: a smaller micro-batch (whole samples: a preference pair is ``rows_per_sample`` sequences),
    checkpointing in this layout, else the first ZeRO preset that fits."""
    mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem) // rows_per_sample * rows_per_sample
    if mb:
        micro = _micro_text(mb, rows_per_sample)
        return f"micro-batch {micro} fits (raise gradient_accumulation_steps to keep the global batch)."
    layout = setup.layout
    ckpt, fix = None, ""
    if isinstance(layout, PipelineLayout) and not layout.checkpoint_interval:
        ckpt = replace(setup, checkpointing=True, layout=replace(layout, checkpoint_interval=1))
        fix = "set pipeline.activation_checkpoint_interval to 1."
    elif layout is None and not setup.checkpointing:
        ckpt, fix = replace(setup, checkpointing=True), "turn on gradient checkpointing."
    if ckpt is not None and max_micro_batch(stats, ckpt, gpu_mem, cpu_mem) >= rows_per_sample:
        return fix
    if isinstance(layout, LayerSplitLayout):
        return "split over more cards (--device-map-devices), or use a ZeRO preset with LoRA or offload."
    n = setup.world_size
    rec = recommend(
        stats,
        n,
        setup.seq_len,
        gpu_mem,
        cpu_mem,
        lora_rank=setup.lora_rank,
        pretrained=setup.pretrained,
        savers=setup.savers,
        min_micro=rows_per_sample,
    )
    if rec is None:
        return "no ds_configs preset fits: use LoRA, a smaller model, shorter sequences or more cards."
    ckpt = " with gradient checkpointing" if rec.setup.checkpointing else ""
    micro = _micro_text(rec.micro_batch, rows_per_sample)
    return f"try ds_configs/{rec.preset}.json{ckpt} at micro-batch {micro} (python -m deepzero.plan)."


# ------------------------------------------------------------------------------------------------- CLI


PAIR_ROWS = 2
"""Sequences per preference pair (chosen and rejected), as train.py's PreferenceDataset reads them."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepzero.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="preset name, local folder with config.json, or hub id")
    parser.add_argument("--fit-table", action="store_true", help="README table: the recommendation for every preset")
    parser.add_argument("--gpus", type=int, default=3, help="data-parallel ranks (cards)")
    parser.add_argument("--gpu-mem", type=float, default=24.0, help="GiB per card (an RTX 4090 has 24)")
    parser.add_argument("--cpu-mem", type=float, default=128.0, help="host RAM in GiB, whole machine")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1, help="micro-batch the table is computed for")
    parser.add_argument("--lora-rank", type=int, default=LORA_RANK, help="rank for the LoRA rows")
    parser.add_argument("--tiled-loss", choices=("on", "off"), default="on", help="as train.py: the LM loss in tiles")
    parser.add_argument(
        "--activation-offload", action="store_true", help="as train.py: checkpointed hidden states in host memory"
    )
    parser.add_argument("--tiled-mlp", choices=("on", "off"), default="off", help="as train.py: MLPs in sequence tiles")
    parser.add_argument(
        "--max-seq-len", action="store_true", help="the longest sequence of every preset and saver choice (micro 1)"
    )
    parser.add_argument(
        "--preference",
        action="store_true",
        help="preference pairs (DPO): --micro-batch pairs = 2 sequences each, log-probs tiled like the LM loss,"
        " no reference model (its log-probs precomputed, or LoRA's adapters off)",
    )
    args = parser.parse_args(argv)
    if args.preference and args.max_seq_len:
        print(
            "error: --max-seq-len: plans one sequence per micro-batch and sequence parallelism, which preference"
            " pairs do not use. Fix: drop --preference, or plan one length with --preference --seq-len N",
            file=sys.stderr,
        )
        return 2
    for flag, value in (("--gpus", args.gpus), ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value < 1:
            print(f"error: {flag} {value}: must be at least 1. Fix: pass a positive number", file=sys.stderr)
            return 2
    if args.fit_table:
        print(fit_table(args.gpus, args.gpu_mem, args.cpu_mem, args.seq_len, args.lora_rank))
        return 0
    if args.model is None:
        print("error: --model: missing. Fix: pass --model NAME (or --fit-table)", file=sys.stderr)
        return 2
    try:
        name, config = planning_config(args.model)
        stats = model_stats(config, name)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    pretrained = not (args.model in PRESETS and PRESETS[args.model].hub_id is None)
    if args.max_seq_len:
        kw = {"pretrained": pretrained, "tiled_loss": args.tiled_loss == "on"}
        print(render_longest(stats, args.gpus, args.gpu_mem, args.cpu_mem, args.lora_rank, **kw))
        return 0
    savers = SaverTerms.choose(stats.arch, args.tiled_loss == "on", args.activation_offload, args.tiled_mlp == "on")
    rows = args.micro_batch * (PAIR_ROWS if args.preference else 1)
    print(
        render(
            stats,
            args.gpus,
            args.gpu_mem,
            args.cpu_mem,
            args.seq_len,
            micro_batch=rows,
            lora_rank=args.lora_rank,
            pretrained=pretrained,
            savers=savers,
            pair_rows=PAIR_ROWS if args.preference else 1,
        )
    )
    if args.preference:
        print(
            f"Preference pairs: micro-batch {args.micro_batch} pair{'s' * (args.micro_batch != 1)} = {rows}"
            " sequences (chosen and rejected), so"
            f" every micro-batch and 'max mb' above counts sequences: pairs = sequences / {PAIR_ROWS}. The log-probs"
            " are tiled over the LM head like the LM loss (--tiled-loss). No reference model is on the cards: its"
            " log-probs are"
            " precomputed in one pass before training (one eval forward at a time), or it is the same model with"
            " its LoRA adapters off (a no-grad forward)."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
