"""Sequence parallelism: every sequence split over ``N`` ranks, for any head count (all-gather context parallelism).

Each rank of a sequence group keeps its contiguous ``S/N`` slice of every row (its queries, targets and per-document
``position_ids``, so RoPE is applied locally at the true positions) and, inside the attention function, all-gathers
the group's keys and values along the sequence; its queries attend to all ``S`` keys under a causal + document mask
built once per micro-batch from the row's global positions (Transformers' packed-sequence rule). Nothing splits heads,
so GQA (12/2, 28/4, ...) and DeepSeek's MLA (key head 192, value head 128) run unchanged at any ``N``; DeepSpeed's
Ulysses needs heads divisible by ``N`` and keys shaped like values. The all-gather's backward sums the group's key and
value gradients and keeps this rank's slice (a reduce-scatter; gloo has none: all-reduce, then slice).

DeepSpeed owns the groups and the gradient reduction: ``deepspeed.initialize(mpu=parallel_state_sp)`` partitions ZeRO
over the sequence × data-parallel ranks and divides the summed gradients by the data-parallel size (world / N); its
config check counts whole sequences (``train_batch_size = micro × accumulation × world / N``).

Per layer and micro-row the all-gather moves ``(N-1)/N · S · (k_dim + v_dim) · kv_heads · bytes`` into each rank in
the forward (again under activation checkpointing) and reduces as much in the backward; no extra FLOPs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepzero.errors import UserError

ATTENTION = "deepzero_sequence_parallel"
"""The name of the attention function in Transformers' ``AttentionInterface`` while a model trains under SP."""
_GROUP: Any = None
"""The process group ``sequence_attention`` gathers over (one sequence group per process)."""


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's place in the world cut into ``size``-rank sequence groups of consecutive ranks × data parallel."""

    size: int
    rank: int
    """Position in the sequence group: which slice of each row this rank keeps."""
    group: Any
    dp_rank: int
    """Which sequence group: the ranks of one read the same rows (the sampler's data-parallel rank)."""
    dp_size: int
    dp_group: Any
    """The ranks holding the same slice in every sequence group (the normalizer's target count is summed there)."""

    @classmethod
    def create(cls, size: int) -> SequenceGroups:
        """DeepSpeed's sequence and sequence-data-parallel groups (``parallel_state_sp``), plus the data-parallel
        ones; every rank must call it."""
        from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp

        world, rank = dist.get_world_size(), dist.get_rank()
        if sp._SEQUENCE_PARALLEL_GROUP is None:
            sp.initialize_sequence_parallel(size)
        dp_group = None
        for column in range(size):
            ranks = list(range(column, world, size))
            made = dist.new_group(ranks)
            dp_group = made if rank in ranks else dp_group
        return cls(size, rank % size, sp.get_sequence_parallel_group(), rank // size, world // size, dp_group)

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a micro-batch and the 4-D mask of its queries against the whole rows."""
        return shard(batch, self.rank, self.size)


def install(model: nn.Module, groups: SequenceGroups) -> nn.Module:
    """Make ``model``'s attention gather keys and values over ``groups``; returns it. The attention implementation
    it had is kept for forwards over whole rows (:func:`whole_rows`)."""
    global _GROUP
    from transformers import AttentionInterface

    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise UserError(
            "sequence_parallel_size",
            f"{config.model_type} with sliding-window layers is not supported under sequence parallelism",
            "set use_sliding_window false in the model config or drop sequence parallelism",
        )
    AttentionInterface.register(ATTENTION, sequence_attention)
    _GROUP = groups.group
    model._whole_row_attention = config._attn_implementation
    config._attn_implementation = ATTENTION
    return model


@contextlib.contextmanager
def whole_rows(model: nn.Module) -> Iterator[None]:
    """Run ``model`` on whole rows, every rank alone (the export's logit probe), with its own attention."""
    config, saved = model.config, model.config._attn_implementation
    config._attn_implementation = getattr(model, "_whole_row_attention", saved)
    try:
        yield
    finally:
        config._attn_implementation = saved


def check_divisible(seq_len: int, size: int, data: Any) -> None:
    """One line at start when rows cannot be cut into ``size`` equal slices."""
    if size > 1 and seq_len % size:
        lower, upper = seq_len - seq_len % size, seq_len - seq_len % size + size
        raise UserError(
            f"{data}/meta.json",
            f"seq_len {seq_len} is not divisible by sequence_parallel_size {size}",
            f"re-run data/prepare.py with --seq-len {lower or upper} or {upper}",
        )


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed document each position belongs to: a new one wherever the position does not grow by 1
    (Transformers' ``find_packed_sequence_indices``)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def shard(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice ``rank`` of ``size`` of every ``[batch, seq]`` tensor, plus ``attention_mask`` ``[batch, 1, S/size, S]``
    (True: attend) from the whole rows' positions: causal and within one document."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    width = seq // size
    start = rank * width
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(rows, -1)
    docs = document_ids(positions)
    query = torch.arange(start, start + width, device=ids.device)
    causal = torch.arange(seq, device=ids.device)[None, :] <= query[:, None]
    same_doc = docs[:, start : start + width, None] == docs[:, None, :]
    out = {k: v[:, start : start + width].contiguous() for k, v in batch.items() if v.dim() == 2 and v.shape[1] == seq}
    out["position_ids"] = positions[:, start : start + width].contiguous()
    out["attention_mask"] = (causal[None] & same_doc)[:, None]
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (``[batch, heads, seq/N, dim]`` → ``[batch, heads, seq, dim]``); backward: the
    group's gradients summed, this rank's slice kept."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        rank, width = dist.get_rank(ctx.group), ctx.width
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce_scatter
            dist.all_reduce(grad, group=ctx.group)
            return grad.narrow(2, rank * width, width).contiguous(), None
        chunks = [c.contiguous() for c in grad.split(width, dim=2)]
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's slices of ``x`` joined along the sequence (dim 2), differentiable."""
    return _GatherSequence.apply(x, group)


def sequence_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention interface: local queries ``[b, h, S/N, d]`` against the group's gathered keys and
    values (any kv-head count, key and value dims may differ: MLA), under the micro-batch's 4-D mask (:func:`shard`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = gather_sequence(key, _GROUP), gather_sequence(value, _GROUP)
    if attention_mask is None or attention_mask.shape[-1] != key.shape[2]:
        raise RuntimeError("sequence-parallel attention needs the micro-batch's mask from sequence_parallel.shard")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_shape(config: Any) -> tuple[int, int, int]:
    """``(kv_heads, key head dim, value head dim)`` as the attention function receives them (MLA: every head)."""
    if getattr(config, "kv_lora_rank", None):
        heads = config.num_attention_heads
        return heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads or config.num_attention_heads, dim, dim


def gathered_bytes(config: Any, seq_len: int, size: int, element_bytes: int) -> int:
    """Bytes each rank receives per layer and row in the forward all-gather (the backward reduces as many)."""
    heads, k_dim, v_dim = attention_shape(config)
    return (size - 1) * (seq_len // size) * (k_dim + v_dim) * heads * element_bytes
