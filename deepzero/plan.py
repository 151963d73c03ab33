"""Memory planner: will a model train under ZeRO 1/2/3 on these cards? Reads only the config (meta device).

``python -m deepzero.plan --model deepseek-coder-1.3b --gpus 3 --gpu-mem 24 --cpu-mem 128 --seq-len 2048``
prints per-card GPU memory (parameters, gradients, optimizer, activations, logits, buffers) and host RAM for
every ZeRO stage / offload / checkpointing / LoRA combination, marks what fits, and recommends a ds_configs
preset with the largest micro-batch that fits. Formulas and sources: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from deepzero.errors import UserError
from deepzero.flops import routed_experts
from deepzero.modeling import planning_config
from deepzero.precision import requested_precision

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
    """(in, out) of every Linear a LoRA adapter would wrap (all linears in the decoder layers)."""

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
    )


def model_stats(config: PretrainedConfig, name: str = "model") -> ModelStats:
    """Count parameters by building the model on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())  # deduplicates tied weights, like DeepSpeed sees them
    numels = tuple(p.numel() for p in params)
    arch = _arch(config, model)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = sum(numels) - routed + (routed * arch.experts_per_token // arch.experts if arch.experts else 0)
    embeds = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora = tuple(
        (m.in_features, m.out_features)
        for n, m in model.model.layers.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] != "gate"
    )
    return ModelStats(name, arch, numels, sum(numels), sum(embeds.values()), routed, active, largest, lora)


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
class Setup:
    """One training configuration to size: ZeRO stage, offload, precision, batch shape, LoRA."""

    stage: int
    world_size: int
    micro_batch: int = 1
    seq_len: int = 2048
    offload_optimizer: bool = False
    offload_params: bool = False
    precision: str = "bf16"
    checkpointing: bool = False
    lora_rank: int = 0
    """0 = full fine-tuning; otherwise the LoRA rank (all decoder linears adapted, base weights frozen)."""
    attention: str = "sdpa"
    """sdpa (flash/memory-efficient kernels, no s² term) or eager (stores the s×s attention probabilities)."""
    zero: ZeroKnobs = field(default_factory=ZeroKnobs)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise UserError("zero_optimization.stage", f"{self.stage} is not a ZeRO stage", "use 0, 1, 2 or 3")
        if self.offload_params and self.stage != 3:
            raise UserError("offload_param", "parameter offload needs ZeRO stage 3", "set stage 3 or drop it")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise UserError("precision", f"unknown precision {self.precision!r}", "use bf16, fp16 or fp32")

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def label(self) -> str:
        off = [w for w, on in (("opt", self.offload_optimizer), ("param", self.offload_params)) if on]
        return f"ZeRO-{self.stage}" + (f" offload {'+'.join(off)}" if off else "")


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
    n = setup.world_size if setup.stage > 0 else 1
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


def _norm(width: int) -> int:
    """HF RMSNorm keeps its fp32 upcast input (4 B) and the normalised bf16 tensor (2 B) for backward."""
    return 6 * width


def _attention_per_token(a: Arch, setup: Setup) -> int:
    """Bytes saved per token by one attention block (16-bit tensors, fp32 softmax statistics)."""
    if a.kv_lora_rank:  # MLA: q via q_a/q_b (or q_proj), k/v via the compressed kv_a -> kv_b path
        qk = a.heads * (a.qk_nope_dim + a.qk_rope_dim)
        v = a.heads * a.v_head_dim
        q_path = _norm(a.q_lora_rank) + 2 * a.q_lora_rank if a.q_lora_rank else 0
        body = 2 * a.hidden + q_path + _norm(a.kv_lora_rank) + 2 * a.kv_lora_rank + 2 * qk + 2 * qk + 2 * v
        out = v
    else:  # MHA/GQA: q, k, v after RoPE are what the attention kernel saves
        body = 2 * a.hidden + 2 * a.heads * a.head_dim + 4 * a.kv_heads * a.head_dim
        out = a.heads * a.head_dim
    body += 2 * out + 4 * a.heads + 2 * out  # kernel output, its fp32 logsumexp, o_proj input
    if setup.attention == "eager":  # fp32 softmax output, bf16 probabilities, dropout mask: 7·heads·s per token
        body += 7 * a.heads * setup.seq_len
    return body


def _mlp_per_token(a: Arch, moe: bool) -> int:
    """SwiGLU: input 2h, gate output 2i (SiLU input), SiLU output 2i, up output 2i, down input 2i."""
    if not moe:
        return 2 * a.hidden + 8 * a.intermediate
    k = a.experts_per_token
    router = 4 * a.hidden + 4 * a.experts  # fp32 router input and sigmoid/softmax scores
    routed = k * (4 * a.hidden + 8 * a.moe_intermediate)  # each token's copy per chosen expert, in and out
    return 2 * a.hidden + router + routed + 8 * a.shared_intermediate


def activation_bytes(stats: ModelStats, setup: Setup) -> int:
    """Saved activations of one micro-batch (Korthikanti et al. 2022, adapted: no dropout, SwiGLU, MLA, MoE)."""
    a, tokens = stats.arch, setup.micro_batch * setup.seq_len
    lora = 2 * setup.lora_rank * len(stats.lora_shapes) // max(a.layers, 1) if setup.lora_rank else 0
    common = 2 * _norm(a.hidden) + _attention_per_token(a, setup) + lora
    dense = common + _mlp_per_token(a, moe=False)
    moe = common + _mlp_per_token(a, moe=True)
    router_weight = 4 * a.experts * a.hidden  # fp32 copy of the router weight, saved per MoE layer
    per_layer = [dense * tokens] * (a.layers - a.moe_layers) + [moe * tokens + router_weight] * a.moe_layers
    final = (_norm(a.hidden) + 2 * a.hidden) * tokens  # final norm + lm_head input
    scale = 2 if setup.precision == "fp32" else 1
    if setup.checkpointing:  # only each layer's input survives; one layer is recomputed at a time
        return scale * (a.layers * 2 * a.hidden * tokens + max(per_layer) + final)
    return scale * (sum(per_layer) + final)


def logits_bytes(stats: ModelStats, setup: Setup) -> int:
    """16-bit logits (2) + fp32 log-softmax kept for the loss (4) + two fp32 gradients in its backward (8)."""
    per_value = 14 if setup.precision != "fp32" else 16
    return per_value * setup.micro_batch * setup.seq_len * stats.arch.vocab


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


def estimate(stats: ModelStats, setup: Setup) -> Estimate:
    """Per-card and host memory of one setup (formulas in docs/memory.md)."""
    p, n = setup.bytes_per_value, setup.world_size
    if setup.lora_rank:
        trainable, frozen = stats.lora_numels(setup.lora_rank), stats.param_numels
    else:
        trainable, frozen = stats.param_numels, ()
    ranks = rank_states(trainable, frozen, setup)
    rs = max(ranks, key=lambda r: r.params + r.grads)
    k = setup.zero
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

    activations = activation_bytes(stats, setup)
    logits = logits_bytes(stats, setup)
    allocated = params + grads + optimizer + max(activations + logits + buffers, step)
    other = CUDA_RESERVE + int(FRAGMENTATION * allocated)

    host_states = 0
    if off_opt:  # fp32 master + m + v, fp32 gradient partition, 16-bit staging buffer, per rank
        host_states += n * (ADAM_K + 4 + p) * rs.optimizer
    if off_par:
        host_states += n * p * (rs.params - rs.persistent)
    # Loading: stages 0-2 build the whole fp32 model on every rank; ZeRO-3 partitions module by module.
    load = n * 4 * (stats.total if setup.stage < 3 else stats.largest_module)
    host = n * HOST_PER_RANK + max(load, host_states)
    return Estimate(
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
        sum(trainable),
    )


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
) -> Recommendation | None:
    """First preset (fastest first) that fits at micro-batch 1, preferring no activation checkpointing."""
    for name in presets:
        ds = load_preset(name)
        for ckpt in (False, True):
            setup = setup_from_ds_config(
                ds,
                world_size=world_size,
                seq_len=seq_len,
                hidden_size=stats.arch.hidden,
                checkpointing=ckpt,
                lora_rank=lora_rank,
                micro_batch=1,
            )
            mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem)
            if mb:
                setup = replace(setup, micro_batch=mb)
                return Recommendation(name, setup, mb, estimate(stats, setup))
    return None


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


def table_setups(stats: ModelStats, world_size: int, seq_len: int, micro_batch: int, lora_rank: int) -> list[Setup]:
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
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    a = stats.arch
    moe = f", MoE {a.moe_layers}/{a.layers} layers, {a.experts_per_token} of {a.experts} experts" if a.experts else ""
    mla = f", MLA (kv rank {a.kv_lora_rank})" if a.kv_lora_rank else ""
    lines = [
        f"{stats.name}: {_count(stats.total)} params ({_count(stats.active)} active per token, "
        f"{_count(stats.embedding)} embedding+lm_head), {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}{mla}{moe}",
        f"{world_size} GPUs × {gpu_mem_gb:g} GiB, host RAM {cpu_mem_gb:g} GiB, seq len {seq_len}, micro-batch "
        f"{micro_batch}, LoRA rank {lora_rank} on {len(stats.lora_shapes)} linears "
        f"({_count(sum(stats.lora_numels(lora_rank)))} trainable).",
        "GiB per card (busiest rank); bf16 and fp16 hold the same bytes (16-bit weights/grads/activations, fp32 "
        "master + Adam m, v), so each row is both.",
        "",
    ]
    headers = ["ZeRO", "offload", "train", "ckpt", "params", "grads", "optim", "activ", "logits", "buffers"]
    headers += ["GPU", "host", "fits", "max mb"]
    rows = []
    for setup in table_setups(stats, world_size, seq_len, micro_batch, lora_rank):
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
        "host = whole machine. max mb = largest micro-batch that fits.",
    ]
    for what, rank in (("full fine-tuning", 0), (f"LoRA r{lora_rank}", lora_rank)):
        rec = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=rank)
        lines.append(_recommendation_line(what, rec, gpu_mem_gb))
    return "\n".join(lines)


def _recommendation_line(what: str, rec: Recommendation | None, gpu_mem_gb: float) -> str:
    if rec is None:
        return f"Recommended for {what}: nothing fits, not even ZeRO-3 with parameter and optimizer offload."
    ckpt = "on" if rec.setup.checkpointing else "off"
    alt = " (or zero2 for fp16)" if rec.preset == "zero2_bf16" else ""
    return (
        f"Recommended for {what}: ds_configs/{rec.preset}.json{alt}, activation checkpointing {ckpt}, "
        f"micro-batch {rec.micro_batch} (peak {_gib(rec.estimate.gpu_total)} of {gpu_mem_gb:g} GiB per card, "
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
    from deepzero.presets import PRESETS

    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    rows = ["| model | full fine-tune | LoRA r16 |", "|---|---|---|"]
    for name, preset in PRESETS.items():
        if preset.hub_id is None:
            continue
        stats = model_stats(preset.config(), name)
        full = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem)
        lora = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=lora_rank)
        rows.append(f"| {name} | {_fit_cell(full, True)} | {_fit_cell(lora, False)} |")
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


def check_fit(
    model_config: PretrainedConfig,
    ds_config: dict[str, Any],
    world_size: int,
    gpu_mem_gb: float | None,
    seq_len: int,
    *,
    gradient_checkpointing: bool = False,
    lora_rank: int = 0,
    cpu_mem_gb: float | None = None,
) -> str | None:
    """A one-line warning when ``ds_config`` will not fit the cards (or host RAM), else None.

    Call before loading weights. ``gpu_mem_gb`` None = detect the smallest visible card; without CUDA there is
    nothing to check and the answer is None. ``cpu_mem_gb`` None = detect the machine's RAM.
    """
    if gpu_mem_gb is None:
        gpu_mem_gb = detected_gpu_mem_gb()
        if gpu_mem_gb is None:
            return None
    if cpu_mem_gb is None:
        cpu_mem_gb = detected_cpu_mem_gb()
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB if cpu_mem_gb else None
    try:
        stats = model_stats(model_config, getattr(model_config, "name_or_path", "") or "model")
    except (ValueError, KeyError, AttributeError) as err:  # e.g. a remote-code architecture
        return f"memory plan skipped: cannot build {model_config.model_type} on the meta device ({err})"
    setup = setup_from_ds_config(
        ds_config,
        world_size=world_size,
        seq_len=seq_len,
        hidden_size=stats.arch.hidden,
        checkpointing=gradient_checkpointing,
        lora_rank=lora_rank,
    )
    est = estimate(stats, setup)
    if est.fits(gpu_mem, cpu_mem):
        return None
    if est.gpu_total > gpu_mem:
        need = (
            f"memory plan: {setup.label()} at micro-batch {setup.micro_batch}, seq {seq_len} needs "
            f"~{_gib(est.gpu_total)} GiB per GPU (params {_gib(est.params)}, grads {_gib(est.grads)}, optimizer "
            f"{_gib(est.optimizer)}, activations {_gib(est.activations)}, logits {_gib(est.logits)}, buffers "
            f"{_gib(est.buffers)}) but the cards have {gpu_mem_gb:.1f} GiB"
        )
    else:
        what = "offloaded states" if est.host_states >= est.host_load else "fp32 model copies while loading"
        need = (
            f"memory plan: {setup.label()} needs ~{_gib(est.host)} GiB of host RAM for {world_size} ranks "
            f"({_gib(max(est.host_states, est.host_load))} of it {what}) but the machine has {cpu_mem_gb:.0f} GiB"
        )
    mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem)
    if mb:
        return f"{need}; micro-batch {mb} fits (raise gradient_accumulation_steps to keep the global batch)."
    if not gradient_checkpointing and max_micro_batch(stats, replace(setup, checkpointing=True), gpu_mem, cpu_mem):
        return f"{need}; turn on gradient checkpointing."
    rec = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=lora_rank)
    if rec is None:
        return f"{need}; no ds_configs preset fits: use LoRA, a smaller model, shorter sequences or more cards."
    ckpt = " with gradient checkpointing" if rec.setup.checkpointing else ""
    return f"{need}; try ds_configs/{rec.preset}.json{ckpt} at micro-batch {rec.micro_batch} (python -m deepzero.plan)."


# ------------------------------------------------------------------------------------------------- CLI


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
    args = parser.parse_args(argv)
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
    print(
        render(
            stats,
            args.gpus,
            args.gpu_mem,
            args.cpu_mem,
            args.seq_len,
            micro_batch=args.micro_batch,
            lora_rank=args.lora_rank,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
