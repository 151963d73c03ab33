"""Sequence parallelism: every sequence split over ``N`` ranks, for any head count (all-gather context parallelism).

Each rank of a sequence group keeps ``S/N`` tokens of every row, two pieces of ``S/2N`` (piece ``r`` and piece
``2N-1-r``: every rank then scores as many keys under causal attention), with their queries, targets and
per-document ``position_ids`` (RoPE is applied locally at the true positions) and, inside the attention function,
all-gathers the group's keys and values along the sequence; its queries attend to the keys they can see under the
causal + document rule read from the whole rows' positions (Transformers' packed-sequence rule), in chunks of
queries whose small masks are rebuilt in backward (:class:`RowLayout`), so no ``[S/N × S]`` mask is ever held.
Nothing splits heads, so GQA (12/2, 28/4, ...) and DeepSeek's MLA (key head 192, value head 128) run unchanged at
any ``N``; DeepSpeed's Ulysses needs heads divisible by ``N`` and keys shaped like values. The all-gather's backward
sums the group's key and value gradients and keeps this rank's pieces (a reduce-scatter; gloo has none: all-reduce,
then slice).

DeepSpeed owns the groups and the gradient reduction: ``deepspeed.initialize(mpu=parallel_state_sp)`` partitions ZeRO
over the sequence × data-parallel ranks and divides the summed gradients by the data-parallel size (world / N); its
config check counts whole sequences (``train_batch_size = micro × accumulation × world / N``).

Per layer and micro-row the all-gather moves ``(N-1)/N · S · (k_dim + v_dim) · kv_heads · bytes`` into each rank in
the forward (again under activation checkpointing) and reduces as much in the backward. FLOPs: the chunks'
attention forward once more in backward (the masks are not kept); keys after a chunk's last query are skipped.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepzero.data import IGNORE_INDEX
from deepzero.errors import UserError

METHOD = "all-gather context parallelism"
CUT = "2N pieces per row, rank r keeps pieces r and 2N-1-r"
"""How the world and each row are cut, as run_config.json says it (:func:`pieces`)."""
ATTENTION = "deepzero_sequence_parallel"
"""The name of the attention function in Transformers' ``AttentionInterface`` while a model trains under SP."""
_GROUP: Any = None
"""The process group ``sequence_attention`` gathers over (one sequence group per process)."""
_CALLS = 0
"""``sequence_attention`` calls since :func:`install` (:func:`check_attention_used` reads it once)."""


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
        """This rank's part of a micro-batch (:func:`shard`)."""
        return shard(batch, self.rank, self.size)


def install(model: nn.Module, groups: SequenceGroups) -> nn.Module:
    """Make ``model``'s attention gather keys and values over ``groups``; returns it. The attention implementation
    it had is kept for forwards over whole rows (:func:`whole_rows`). Its first forward checks that the attention
    really went through :func:`sequence_attention` (:func:`check_attention_used`)."""
    global _GROUP, _CALLS
    from transformers import AttentionInterface

    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise UserError(
            "sequence_parallel_size",
            f"{config.model_type} with sliding-window layers is not supported under sequence parallelism",
            "set use_sliding_window false in the model config or drop sequence parallelism",
        )
    if kind := position_dependent_rope(config):
        raise UserError(
            "sequence_parallel_size",
            f"{config.model_type}'s rope_type {kind!r} scales its frequencies by the longest position a forward sees,"
            " which differs between the ranks' pieces of a row",
            "drop sequence parallelism, or set rope_scaling to a static type (linear, yarn, llama3) in the model config",
        )
    AttentionInterface.register(ATTENTION, sequence_attention)
    _GROUP, _CALLS = groups.group, 0
    model._whole_row_attention = config._attn_implementation
    config._attn_implementation = ATTENTION
    model._sequence_check = model.register_forward_hook(check_attention_used)
    for module in model.modules():
        if getattr(config, "kv_lora_rank", None) and callable(getattr(module, "expand_kv", None)):
            module.expand_kv = _latent_gathered(module, module.expand_kv)
    return model


def _latent_gathered(module: nn.Module, expand_kv: Any) -> Any:
    """MLA's ``expand_kv`` (Transformers' DeepSeek V2/V3 attention: the compressed latent ``[b, 1, s, r]`` and the
    rotated shared key ``[b, 1, s, rope]`` → every head's keys and values) on the group's gathered latent: the
    all-gather moves ``r + rope`` values per token (576 for V2-Lite and V3) instead of every head's expanded keys and
    values (16 × (192 + 128) = 5,120 for V2-Lite), and each rank expands the whole rows itself (``kv_b_proj`` on S
    tokens instead of S/N). :func:`sequence_attention` then finds the keys already whole and gathers nothing."""

    def gathered(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if module.config._attn_implementation != ATTENTION:  # a whole-row forward (the export's probe)
            return expand_kv(kv_nope, k_rot)
        return expand_kv(gather_sequence(kv_nope, _GROUP), gather_sequence(k_rot, _GROUP))

    return gathered


POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the largest position in the forward (Transformers' dynamic update)."""


def position_dependent_rope(config: Any) -> str | None:
    """The model's RoPE type when it is one of :data:`POSITION_DEPENDENT_ROPE` (None otherwise)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    kinds = {r.get("rope_type") or r.get("type") for r in per_layer if isinstance(r, dict)}
    return next((k for k in POSITION_DEPENDENT_ROPE if k in kinds), None)


def check_attention_used(model: nn.Module, args: Any, output: Any) -> None:
    """Forward hook: after the first forward under sequence parallelism, stop with one line when no layer called
    :func:`sequence_attention` (a model whose attention classes ignore Transformers' attention interface, e.g.
    remote code, would attend only within each rank's pieces); then removes itself."""
    if model.config._attn_implementation != ATTENTION:  # a whole-row forward (the export's probe)
        return
    if _CALLS == 0:
        raise UserError(
            "sequence_parallel_size",
            f"{model.config.model_type}'s attention did not call Transformers' attention interface (its own attention"
            " classes, e.g. remote code): each rank would attend only within its own pieces of every row",
            "drop sequence parallelism for this model",
        )
    model._sequence_check.remove()


@contextlib.contextmanager
def whole_rows(model: nn.Module) -> Iterator[None]:
    """Run ``model`` on whole rows, every rank alone (the export's logit probe), with its own attention."""
    config, saved = model.config, model.config._attn_implementation
    config._attn_implementation = getattr(model, "_whole_row_attention", saved)
    try:
        yield
    finally:
        config._attn_implementation = saved


def padded_length(seq: int, size: int) -> int:
    """The row length ``size`` ranks train on: ``seq`` rounded up to a multiple of ``2 × size`` (:func:`pieces`),
    so any prepared length trains under any group size. The padding is masked: it attends only to itself (each
    padding token is its own document), has no target and is left out of the routers' loads."""
    parts = 2 * size
    return -(-seq // parts) * parts if size > 1 else seq


PAD_VALUES = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}
"""What a row is padded with, per key (others: 0; ``position_ids`` 0 makes every padding token its own document)."""


def pad_rows(x: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    """``x`` ``[rows, seq, ...]`` padded at the end of dim 1 to ``length`` with ``value`` (itself when no padding)."""
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), value)], dim=1)


def local_mask(real: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """``rank``'s part of a whole rows' real-token mask ``[rows, seq]``, the padding :func:`shard` adds False."""
    return local_part(pad_rows(real, padded_length(real.shape[1], size), False), rank, size)


def pieces(seq: int, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two pieces of a row of ``seq`` that ``rank`` keeps, ``(start, end)`` each: the row cut into ``2 × size``
    equal pieces, rank r keeps piece r and piece 2·size − 1 − r, so under causal attention every rank scores as
    many keys (the balanced cut of Llama 3's context parallelism)."""
    half = seq // (2 * size)
    return (rank * half, (rank + 1) * half), ((2 * size - 1 - rank) * half, (2 * size - rank) * half)


def local_part(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s two pieces of ``x`` along ``dim`` (a whole row's length), joined."""
    (a, b), (c, d) = pieces(x.shape[dim], rank, size)
    return torch.cat([x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)], dim=dim)


def whole_row(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole rows from the group's local parts (``parts[r]``: rank r's two pieces along ``dim``), in order."""
    size = len(parts)
    halves = [h for part in parts for h in part.chunk(2, dim=dim)]  # piece r at 2r, piece 2N-1-r at 2r+1
    order = [2 * p if p < size else 2 * (2 * size - 1 - p) + 1 for p in range(2 * size)]
    return torch.cat([halves[i] for i in order], dim=dim)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed document each position belongs to: a new one wherever the position does not grow by 1
    (Transformers' ``find_packed_sequence_indices``)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def shard(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """``rank``'s two pieces (:func:`pieces`) of every ``[batch, seq]`` tensor, the rows first padded to
    :func:`padded_length`, ``position_ids`` always (the whole rows' own or ``arange``): the attention reads the rows'
    documents from them (:class:`RowLayout`). A padding ``attention_mask`` is dropped: the loss masks padding, and
    each padding token is its own document."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    length = padded_length(seq, size)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(rows, -1)
    whole = {k: v for k, v in batch.items() if v.dim() == 2 and v.shape[1] == seq and k != "attention_mask"}
    whole["position_ids"] = positions
    return {k: local_part(pad_rows(v, length, PAD_VALUES.get(k, 0)), rank, size) for k, v in whole.items()}


MASK_ELEMENTS = 2**25
"""Most query × key mask entries one attention chunk builds (all rows; 128 MiB as sdpa's float mask): a rank's
queries are cut into chunks of ``MASK_ELEMENTS // (rows × seq)`` so no [seq/N × seq] mask is ever held."""


@dataclass(frozen=True)
class RowLayout:
    """The whole rows' documents, as one rank's attention reads them, and its queries cut into chunks."""

    docs: torch.Tensor
    """``[rows, seq]``: the packed document of each position (:func:`document_ids`)."""
    chunks: tuple[tuple[int, int, int, int], ...]
    """``(first query, end query, its position in the row, first key)``: the queries local to this rank (its two
    pieces, joined), the key a position in the row (the earliest document start any row needs; keys after the
    chunk's last query are never visible)."""

    @classmethod
    def of(cls, positions: torch.Tensor, rank: int, size: int, mask_elements: int | None = None) -> RowLayout:
        """The layout for the whole rows' ``positions`` ``[rows, seq]`` (one host sync per micro-batch)."""
        rows, seq = positions.shape
        docs = document_ids(positions)
        index = torch.arange(seq, device=positions.device).expand(rows, -1)
        new_doc = torch.diff(docs, prepend=docs[:, :1] - 1, dim=-1) != 0
        doc_start = torch.where(new_doc, index, torch.zeros_like(index)).cummax(-1).values
        pieces_ = pieces(seq, rank, size)
        half = pieces_[0][1] - pieces_[0][0]
        step = max(1, min(half, (mask_elements or MASK_ELEMENTS) // (rows * seq)))
        chunks = [
            (local + q, local + min(q + step, half), start + q)
            for local, (start, _) in zip((0, half), pieces_, strict=True)
            for q in range(0, half, step)
        ]
        keys = doc_start[:, [row for _, _, row in chunks]].min(0).values.tolist()
        return cls(docs, tuple((*chunk, key) for chunk, key in zip(chunks, keys, strict=True)))

    def mask(self, first: int, end: int, row: int, first_key: int) -> torch.Tensor:
        """``[rows, 1, end - first, keys]`` (True: attend) of the queries ``first:end`` (from position ``row``)
        against the keys ``first_key`` up to the last query: causal and within one document."""
        query = torch.arange(row, row + end - first, device=self.docs.device)
        key = torch.arange(first_key, row + end - first, device=self.docs.device)
        causal = key[None, :] <= query[:, None]
        same_doc = self.docs[:, query, None] == self.docs[:, None, key]
        return (causal[None] & same_doc)[:, None]


_LAYOUT: tuple[Any, RowLayout] | None = None
"""The last micro-batch's layout and a weak reference to its local ``position_ids`` (every layer gets that tensor)."""


def row_layout(position_ids: torch.Tensor, group: Any) -> RowLayout:
    """The layout of the rows whose slice ``position_ids`` is: the group's slices gathered once per micro-batch."""
    global _LAYOUT
    if _LAYOUT is not None and _LAYOUT[0]() is position_ids:
        return _LAYOUT[1]
    size = dist.get_world_size(group)
    parts = [torch.empty_like(position_ids) for _ in range(size)]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    layout = RowLayout.of(whole_row(parts, dim=1), dist.get_rank(group), size)
    _LAYOUT = (weakref.ref(position_ids), layout)
    return layout


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (``[batch, heads, seq/N, dim]`` → ``[batch, heads, seq, dim]``, the pieces put back
    in row order); backward: the group's gradients summed, this rank's pieces kept."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return whole_row(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter
            grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's tensor is not ours to change
            dist.all_reduce(grad, group=group)
            return local_part(grad, rank, size, dim=2).contiguous(), None
        chunks = [local_part(grad, r, size, dim=2).contiguous() for r in range(size)]
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, chunks, group=group)
        return out, None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The group's slices of ``x`` joined along the sequence (dim 2), differentiable."""
    return _GatherSequence.apply(x, group)


def _chunk_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: RowLayout,
    chunk: tuple[int, int, int, int],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Transformers' sdpa of one chunk of queries against its keys, under the chunk's mask, ``[b, q, h, v_dim]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, layout.mask(*chunk), **kwargs)[0]


def sequence_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention interface: local queries ``[b, h, S/N, d]`` against the group's gathered keys and
    values (any kv-head count, key and value dims may differ: MLA), chunk by chunk of queries. Each chunk's mask (and
    GQA's repeated keys) is rebuilt in backward (checkpointed), so a layer keeps only its queries, the gathered keys
    and values and its output: no [S/N × S] tensor, at the price of one more attention forward per layer."""
    global _CALLS
    if position_ids is None:
        raise RuntimeError("sequence-parallel attention needs the slice's position_ids (sequence_parallel.shard)")
    _CALLS += 1
    if key.shape[2] == query.shape[2]:  # this rank's slice (MLA's latent path gathered its rows already)
        key, value = gather_sequence(key, _GROUP), gather_sequence(value, _GROUP)
    layout = row_layout(position_ids, _GROUP)
    outputs = []
    for first, end, row, first_key in layout.chunks:
        keys = slice(first_key, row + end - first)
        outputs.append(
            checkpoint(
                _chunk_attention,
                module,
                query[:, :, first:end],
                key[:, :, keys],
                value[:, :, keys],
                layout,
                (first, end, row, first_key),
                kwargs,
                use_reentrant=False,
            )
        )
    return torch.cat(outputs, dim=1), None


def attention_shape(config: Any) -> tuple[int, int, int]:
    """``(kv_heads, key head dim, value head dim)`` as the attention function receives them (MLA: every head)."""
    if getattr(config, "kv_lora_rank", None):
        heads = config.num_attention_heads
        return heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads or config.num_attention_heads, dim, dim


def gathered_values(config: Any) -> int:
    """Values per token the all-gather moves per layer: MLA's latent and rotated shared key (:func:`_latent_gathered`),
    else every kv head's key and value."""
    if getattr(config, "kv_lora_rank", None):
        return config.kv_lora_rank + config.qk_rope_head_dim
    heads, k_dim, v_dim = attention_shape(config)
    return heads * (k_dim + v_dim)


def gathered_bytes(config: Any, seq_len: int, size: int, element_bytes: int) -> int:
    """Bytes each rank receives per layer and row in the forward all-gather (the backward reduces as many)."""
    return (size - 1) * (padded_length(seq_len, size) // size) * gathered_values(config) * element_bytes


def whole_row_kv_bytes(config: Any, seq_len: int, size: int, element_bytes: int) -> int:
    """Bytes of one layer's keys and values over a whole (padded) row, which every rank holds for its attention
    (gathered, or for MLA expanded from the gathered latent)."""
    heads, k_dim, v_dim = attention_shape(config)
    return padded_length(seq_len, size) * heads * (k_dim + v_dim) * element_bytes
