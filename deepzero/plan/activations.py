"""What one micro-batch's forward leaves for backward: saved activations per layer (with checkpointing,
offload, tiled MLP, sequence parallelism) and the loss's working set over the LM head."""

from __future__ import annotations

from deepzero import memory_savers
from deepzero.plan.arch import Arch, ModelStats
from deepzero.plan.setup import Setup
from deepzero.sequence_parallel import MASK_ELEMENTS, padded_length
from deepzero.tiled_loss import TiledLoss


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
    a = stats.arch
    tiles = setup.savers.mlp_tiles(a, setup.seq_len // setup.sequence_parallel)
    width = max(a.intermediate if len(stats.moe_mask) != sum(stats.moe_mask) else 0, a.shared_intermediate)
    return memory_savers.mlp_tile_bytes(setup.tokens, tiles, width, a.hidden)


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
    """Sequence parallelism: the whole (padded) rows' keys and values one layer's attention holds and keeps for
    backward, 16-bit (``sequence_parallel.whole_row_kv_bytes``: all-gathered, or for MLA expanded on each rank from
    the gathered latent, which it keeps too); 0 without it."""
    if setup.sequence_parallel <= 1:
        return 0
    a = stats.arch
    mla = a.heads * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)  # every head's expanded key and value
    width = mla + a.kv_lora_rank + a.qk_rope_dim if a.kv_lora_rank else 2 * a.kv_heads * a.head_dim  # + MLA's latent
    return 2 * width * setup.micro_batch * padded_length(setup.seq_len, setup.sequence_parallel)


def sequence_mask_bytes(setup: Setup) -> int:
    """Sequence parallelism: one attention chunk's causal + document mask (bool, and sdpa's float copy in the
    training dtype), rebuilt per chunk and freed (``sequence_parallel.MASK_ELEMENTS`` bounds it); 0 without it."""
    if setup.sequence_parallel <= 1:
        return 0
    row = padded_length(setup.seq_len, setup.sequence_parallel)
    piece = row // (2 * setup.sequence_parallel)  # a chunk's queries lie in one of the rank's two pieces
    elements = min(MASK_ELEMENTS, setup.micro_batch * piece * row)
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
    return memory_savers.offloaded_bytes(a.layers, a.hidden, setup.tokens, setup.bytes_per_value)


def logits_bytes(stats: ModelStats, setup: Setup) -> int:
    """The loss's working set over the LM head: ``tiled_loss.TiledLoss.working_bytes``, the formula that lives next
    to the code it counts (untiled: 16-bit logits, fp32 log-softmax and two fp32 gradients per [tokens × vocab]
    value, 12 in fp32, measured on the CPU by bench/long_context.py; tiled: one tile's values, the fp32 weight
    gradient and the 16-bit run's vocabulary blocks, the per-token log-sum-exp and the hidden-state gradient)."""
    a = stats.arch
    loss = TiledLoss(bool(setup.savers.loss_tiles), setup.savers.loss_tiles)
    head_trains = not setup.lora_rank  # a LoRA run's LM head is frozen: no weight gradient
    return loss.working_bytes(setup.tokens, a.vocab, a.hidden, setup.bytes_per_value, head_trains)
