"""Bytes per card and host RAM of one ``Setup``: ZeRO's model states as DeepSpeed lays them out, what each
rank or card of a layout holds, and the ``estimate`` that adds activations, logits and buffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepzero.adapters import quant
from deepzero.adapters.lora_export import IN_MEMORY_COPIES
from deepzero.adapters.merge import EXPORT_SHARDS
from deepzero.plan.activations import activation_bytes, logits_bytes, offloaded_bytes
from deepzero.plan.arch import ModelStats
from deepzero.plan.generation import generation_bytes, reference_copy_bytes
from deepzero.plan.setup import LayerSplitLayout, PipelineLayout, Setup

GiB = 2**30
ADAM_K = 12
"""Bytes per trainable parameter of fp32 optimizer state: master copy 4 + Adam m 4 + v 4 (ZeRO paper's K)."""
CUDA_RESERVE = 1 * GiB
"""CUDA context, cuBLAS workspace and NCCL buffers: on the card but outside torch's allocator."""
FRAGMENTATION = 0.05
"""Share of allocated bytes the caching allocator loses to fragmentation."""
HOST_PER_RANK = 3 * GiB
"""Host RAM of one training process before any model bytes (Python, torch, CUDA host state)."""
PUBLISHED_SHARD_BYTES = 9 * 10**9
"""The largest safetensors shard of the published bases the streamed export reads (R1-Distill-Qwen-32B: 8 files and
R1-Distill-Llama-70B: 17 files of at most ~8.7 GB)."""


def gib(n: float) -> str:
    """Bytes as GiB with one decimal, as every report prints them."""
    return f"{n / GiB:.1f}"


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
    load: int = 0
    """Bytes on the card while the model loads, before the engine holds its states: a 4-bit base, whole on every
    card under ZeRO-0/1/2, partitioned under ZeRO-3 (``four_bit_load_bytes``); 0 where loading never holds more
    than the states."""
    generation: int = 0
    """GRPO: what generating one group adds to the states (``plan.generation.generation_bytes``); 0 without it."""

    @property
    def allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: states + the largest of the backward, step and generation
        working sets, or the load if that is more."""
        states = self.params + self.grads + self.optimizer
        working = max(self.activations + self.logits + self.buffers, self.step, self.generation)
        return max(states + working, self.load)

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
        frozen = stats.float_numels(setup.four_bit) + _packed_numels(stats, setup) * setup.four_bit
        return [Share("every rank", stats.lora_numels(setup.lora_rank), frozen, range(layers), True)]
    return [Share("every rank", stats.param_numels, (), range(layers), True)]


def _packed_numels(stats: ModelStats, setup: Setup) -> tuple[int, ...]:
    """A 4-bit base's NF4 codes as DeepSpeed sees them: elements of the training dtype's size (ZeRO-3 stores them
    so, and partitions them like any parameter; ZeRO-0/1/2 keep them whole as uint8, the same bytes)."""
    p = setup.bytes_per_value
    return tuple(-(-quant.packed_bytes(n) // p) for n in stats.four_bit_numels())


def _quant_state_bytes(stats: ModelStats) -> int:
    """Every 4-bit weight's ``QuantState`` (absmax constants and tables): not parameters, whole on every rank."""
    return sum(map(quant.quant_state_bytes, stats.four_bit_numels()))


def _four_bit_weight_bytes(stats: ModelStats, setup: Setup) -> tuple[int, ...]:
    """Bytes of each parameter of a 4-bit base: the NF4 codes of the quantised weights, the other weights in the
    training dtype (``quant.prepare`` keeps them so)."""
    codes = map(quant.packed_bytes, stats.four_bit_numels())
    return (*codes, *(setup.bytes_per_value * n for n in stats.float_numels(True)))


def _adapter_bytes(stats: ModelStats, setup: Setup) -> int:
    """The LoRA adapters over a 4-bit base, in fp32 (peft's default)."""
    return 4 * sum(stats.lora_numels(setup.lora_rank))


def four_bit_base_bytes(stats: ModelStats, setup: Setup, adapters: bool = True) -> int:
    """Bytes of a whole 4-bit base once loaded: its parameters (:func:`_four_bit_weight_bytes`), the codes'
    constants, and with ``adapters`` the adapters (:func:`_adapter_bytes`)."""
    weights = sum(_four_bit_weight_bytes(stats, setup)) + _quant_state_bytes(stats)
    return weights + (_adapter_bytes(stats, setup) if adapters else 0)


def four_bit_load_bytes(stats: ModelStats, setup: Setup) -> int:
    """Bytes on each card while a 4-bit base loads, before ``deepspeed.initialize``. ZeRO-0/1/2: the whole base on
    every card (Transformers' 4-bit loader has no ``zero.Init``). ZeRO-3 (``deepzero.adapters.partitioned_load``): this rank's
    partition of the base, the constants and adapters whole, and one whole tensor on its way to being partitioned."""
    if setup.stage != 3:
        return four_bit_base_bytes(stats, setup)
    weights = _four_bit_weight_bytes(stats, setup)
    whole = _quant_state_bytes(stats) + _adapter_bytes(stats, setup)
    return -(-sum(weights) // setup.world_size) + whole + max(weights)


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
    if setup.four_bit:  # each 4-bit weight's QuantState is not a parameter: whole on every rank
        params += _quant_state_bytes(stats)
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
    if setup.four_bit:
        buffers += dequantised_bytes(stats, setup)
    params += reference_copy_bytes(stats, setup)  # GRPO's frozen reference (beta > 0, full fine-tuning)
    return params, grads, optimizer, step, buffers, rs


def dequantised_bytes(stats: ModelStats, setup: Setup) -> int:
    """A 4-bit base's weights in the compute dtype at once: the layer being computed (a Linear's weight, or a MoE
    layer's fused experts, all dequantised while the layer runs), and without activation checkpointing every MoE
    layer's experts, which autograd keeps for backward (checkpointing recomputes them a layer at a time)."""
    in_flight = max((*stats.four_bit_numels(), *stats.dequantised_experts), default=0)
    kept = 0 if setup.checkpointing else sum(stats.dequantised_experts)
    return setup.bytes_per_value * max(in_flight, kept)


def host_bytes(stats: ModelStats, setup: Setup, rs: RankStates) -> tuple[int, int, int]:
    """(host RAM of the machine, offloaded states, transient load bytes): pretrained weights load in the training
    dtype, a random-init model is built in fp32; every process builds the whole model in host RAM except under
    ZeRO-3 and for a 4-bit base (each tensor straight to the card; under ZeRO-3 one rank at a time holds the whole
    4-bit base: ``deepzero.adapters.partitioned_load``)."""
    p, n = setup.bytes_per_value, setup.world_size
    procs = 1 if isinstance(setup.layout, LayerSplitLayout) else n
    host_states = 0
    if setup.offload_optimizer:  # fp32 master + m + v, fp32 gradient partition, 16-bit staging buffer, per rank
        host_states += n * (ADAM_K + 4 + p) * rs.optimizer
    if setup.offload_params:
        host_states += n * p * (rs.params - rs.persistent)
    host_states += procs * offloaded_bytes(stats, setup)
    load_bytes = p if setup.pretrained else 4
    # ZeRO-3 partitions module by module while loading; a 4-bit load puts each tensor on the card as it reads it
    streamed = setup.layout is None and (setup.stage == 3 or setup.four_bit)
    load = procs * load_bytes * (stats.largest_module if streamed else stats.total)
    if setup.four_bit and (setup.stage == 3 or stats.dequantised_experts):  # the ranks take turns: one whole
        # 4-bit base in host RAM at a time (the adapters are made on the card) with its fused experts still in 16 bits
        # (quantised once loaded), plus the 16-bit tensor being read and, for a quantised one, the quantiser's
        reading = [p * n for n in stats.param_numels] + [
            (p + quant.QUANTISE_BYTES) * n for n in stats.four_bit_numels()
        ]
        experts = p * sum(stats.dequantised_experts)
        load = four_bit_base_bytes(stats, setup, adapters=False) + experts + max(reading)
    export = export_host_bytes(stats, setup)  # rank 0, once the others only wait
    return procs * HOST_PER_RANK + max(load, host_states, export), host_states, load


def export_host_bytes(stats: ModelStats, setup: Setup) -> int:
    """Host bytes of rank 0's export of a LoRA or QLoRA run on the ZeRO engine (``deepzero.adapters.exporters``; 0
    for any other run). From the base's files (a 4-bit base; a pretrained 16-bit one unless the adapters are on the
    fused experts): a few shards at once plus the adapters, whatever the model's size, the shard being the folder's
    own largest file where the base is on disk (a folder written with one 50 GB file costs that), else the published
    bases' largest. Otherwise (a random-init base, adapters on the fused experts) the engine's whole model merged in
    memory: ``IN_MEMORY_COPIES`` of it in the training dtype."""
    if not setup.lora_rank or setup.layout is not None:
        return 0
    if setup.four_bit or (setup.pretrained and not setup.expert_adapters):
        shard = stats.largest_shard_bytes or min(PUBLISHED_SHARD_BYTES, setup.bytes_per_value * stats.total)
        return EXPORT_SHARDS * shard + _adapter_bytes(stats, setup)
    return int(IN_MEMORY_COPIES * setup.bytes_per_value * stats.total)


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
                four_bit_load_bytes(stats, setup) if setup.four_bit else 0,
                generation_bytes(stats, setup) if share.head else 0,
            )
        )
    return max(out, key=lambda e: e.gpu_total)
