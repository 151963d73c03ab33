"""The causal-LM loss over the LM head in token tiles: the [tokens × vocab] logits are never held whole.

Each tile's logits are computed, reduced to their log-sum-exp and the target's logit, and dropped; backward
recomputes them tile by tile (one more LM-head matmul: about +1/3 of the head's FLOPs, +2–5 % of a step for the
DeepSeek presets). Working memory is one tile's logits and their gradient instead of three [tokens × vocab] fp32
tensors (logits, softmax, gradient). Ignored targets (-100) are dropped before the LM head, so prompt and
padding tokens cost nothing there. The sum is divided by ``num_items_in_batch`` exactly as Transformers' own
``ForCausalLMLoss`` does, so the token-weighted normalizer of the engines is unchanged.

The loss runs inside the LM head module's own call: under ZeRO-3 its weight is gathered once per micro-batch (by
the module's hooks, as for any Linear), not once per tile. It plugs in as the model's ``forward`` when labels are
given (without labels, e.g. the export check, the model's own forward runs), so every engine built on the Hugging
Face model — ZeRO-0/1/2/3, LoRA, the layer split — trains with it unchanged.
"""

from __future__ import annotations

import math
import types
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from deepzero.data import IGNORE_INDEX

MIN_TILE_ROWS = 256


@dataclass(frozen=True)
class TiledLoss:
    """The loss decision recorded in the header and run_config.json: tiled or not, and how the tiles are cut."""

    enabled: bool
    tiles_per_vocab: int = 0
    """Tiles per micro-batch target count: ceil(vocab / hidden), so a tile's logits are about the size of the
    hidden states ([tokens × hidden]) whatever the vocabulary (Liger's rule); 0 when off."""
    min_tile_rows: int = MIN_TILE_ROWS
    """No tile is cut smaller (unless the micro-batch has fewer targets): each tile reads and writes the whole
    [vocab × hidden] weight gradient once, so tiles of a few rows would be bound by memory traffic, not matmuls."""

    def tile_rows(self, targets: int) -> int:
        """Rows of each tile for a micro-batch with ``targets`` real targets."""
        return max(1, math.ceil(targets / max(self.tiles_per_vocab, 1)), min(targets, self.min_tile_rows))

    def working_bytes(self, tokens: int, vocab: int, hidden: int, element_bytes: int, head_trains: bool = True) -> int:
        """Peak bytes of the loss's working set over the LM head for a micro-batch of ``tokens`` targets, in a run
        whose values are ``element_bytes`` wide (2: bf16/fp16, 4: fp32) — what the planner counts (one formula, next
        to the code it describes). Per logit value of one tile: the 16-bit logits and their fp32 copy, the fp32
        softmax gradient and its scaled 16-bit cast (14; fp32: 12); the fp32 weight-gradient accumulator ``[V × H]``
        and, in 16-bit, either one vocabulary block's product and its fp32 copy (:func:`vocab_block`) or the final
        cast to the weight's dtype, whichever is larger; the per-token fp32 log-sum-exp and the hidden-state
        gradient. A frozen head (``head_trains`` False: LoRA) has no weight gradient, so no accumulator and no block.
        Untiled (``enabled`` False): the same 14 (12) per value of the whole ``[tokens × vocab]``."""
        per_value = 14 if element_bytes == 2 else 12
        if not self.enabled:
            return per_value * tokens * vocab
        rows = self.tile_rows(tokens)
        accumulator = 4 * vocab * hidden if head_trains else 0
        if element_bytes == 2 and head_trains:
            accumulator += max(2 * vocab * hidden, 6 * vocab_block(rows, vocab, hidden) * hidden)
        return per_value * rows * vocab + accumulator + 4 * tokens + element_bytes * tokens * hidden

    def describe(self) -> str:
        if not self.enabled:
            return "loss: untiled (the whole [tokens × vocab] logits; --tiled-loss on to tile)"
        return (
            f"loss: tiled over the LM head ({self.tiles_per_vocab} token tiles per micro-batch of at least"
            f" {self.min_tile_rows} targets, logits never whole)"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def choose(cls, mode: str, vocab_size: int, hidden_size: int) -> TiledLoss:
        """``--tiled-loss on|off`` for a model's vocabulary and hidden size: a vocabulary no larger than the hidden
        size gives one tile, which saves nothing, so it stays off there."""
        tiles = math.ceil(vocab_size / hidden_size)
        return cls(True, tiles) if mode == "on" and tiles > 1 else cls(False)


class _TiledCrossEntropy(torch.autograd.Function):
    """Each row's ``CE(hidden_t @ weight.T, target_t)`` ([T], fp32) for rows ``hidden`` [T, H] whose targets [T]
    are all real (no -100), in tiles of ``tile`` rows; the logits are computed in the weight's dtype and upcast to
    fp32 for the softmax, as Transformers' loss does. Backward scales each row by its own incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        tile: int,
        entropy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], tile):
            rows = slice(start, start + tile)
            logits = (hidden[rows] @ weight.t()).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            losses[rows] = lse[rows] - logits.gather(1, targets[rows, None]).squeeze(1)
            if entropy is not None:  # each row's softmax entropy from the same tile (no gradient: a statistic)
                entropy[rows] = lse[rows] - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.tile = tile
        return losses

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        scale = grad.float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # a frozen LM head (LoRA): no [V × H] accumulator and no weight products
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.tile):
            rows = slice(start, start + ctx.tile)
            logits = (hidden[rows] @ weight.t()).float()
            dlogits = torch.exp(logits - lse[rows, None])  # softmax
            dlogits.scatter_add_(1, targets[rows, None], torch.full_like(lse[rows, None], -1.0))
            dlogits = (dlogits * scale[rows, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = dlogits @ weight
            if grad_weight is None:
                continue
            if grad_weight.dtype == dlogits.dtype:
                grad_weight.addmm_(dlogits.t(), hidden[rows])  # in place: no [V × H] temporary per tile
                continue
            block = vocab_block(dlogits.shape[0], weight.shape[0], weight.shape[1])
            for first in range(0, weight.shape[0], block):  # 16-bit products upcast block by block, not [V × H]
                vocab = slice(first, first + block)
                grad_weight[vocab] += (dlogits[:, vocab].t() @ hidden[rows]).float()
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None


def vocab_block(tile: int, vocab: int, hidden: int) -> int:
    """Vocabulary rows per block of a 16-bit run's weight-gradient accumulation: a block's ``[rows × hidden]``
    product (and its fp32 copy) holds as many elements as the tile's ``[tile × vocab]`` logits, so no temporary of
    the backward is larger than the tile's own logits (an fp32 run accumulates in place: no block)."""
    return max(1, min(vocab, tile * vocab // hidden))


def _real_targets(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden rows [T, H] of the real targets (not -100), those targets, and each one's position in the
    flattened ``targets`` (one host sync: the tile sizes need the count)."""
    flat, goal = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).to(hidden.device)
    keep = (goal != IGNORE_INDEX).nonzero().squeeze(1)
    return flat.index_select(0, keep), goal.index_select(0, keep), keep


def tiled_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, normalizer: torch.Tensor, choice: TiledLoss
) -> torch.Tensor:
    """The summed cross-entropy of ``hidden`` [..., H] against ``targets`` [...] (-100 ignored) over the LM head
    ``weight`` [V, H], divided by ``normalizer``; in tiles of the real targets as ``choice`` cuts them."""
    rows, goal, _ = _real_targets(hidden, targets)
    losses = _TiledCrossEntropy.apply(rows, weight, goal, choice.tile_rows(rows.shape[0]))
    return losses.sum() / normalizer.to(hidden.device, torch.float32)


def tiled_row_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, choice: TiledLoss
) -> torch.Tensor:
    """Each sequence's summed log-probability of its real targets, ``[batch]`` fp32, from ``hidden`` [batch, seq, H]
    over the LM head in tiles: a preference loss's log-probs without the [tokens × vocab] logits."""
    rows, goal, where = _real_targets(hidden, targets)
    losses = _TiledCrossEntropy.apply(rows, weight, goal, choice.tile_rows(rows.shape[0]))
    sums = torch.zeros(targets.shape[0], dtype=torch.float32, device=hidden.device)
    return -sums.index_add(0, torch.div(where, targets.shape[-1], rounding_mode="floor"), losses)


def tiled_token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, choice: TiledLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probability of its target and the entropy of its next-token distribution, both
    ``[batch, seq]`` fp32 and 0 where the target is -100, from ``hidden`` [batch, seq, H] over the LM head in tiles
    (GRPO's per-token log-probs without the [tokens × vocab] logits; the entropy carries no gradient)."""
    rows, goal, where = _real_targets(hidden, targets)
    entropy = torch.zeros(rows.shape[0], dtype=torch.float32, device=hidden.device)
    losses = _TiledCrossEntropy.apply(rows, weight, goal, choice.tile_rows(rows.shape[0]), entropy)
    flat = torch.zeros(targets.numel(), dtype=torch.float32, device=hidden.device)
    logps = (-flat.index_add(0, where, losses)).view(targets.shape)
    return logps, flat.index_add(0, where, entropy).view(targets.shape)


def _head_forward(
    self: nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor | None = None,
    normalizer: torch.Tensor | None = None,
    choice: TiledLoss | None = None,
    per_token: bool = False,
) -> Any:
    """The LM head's forward: its logits; with ``targets`` the tiled loss, or each row's log-probs when
    ``normalizer`` is None, or each token's log-prob and entropy (``per_token``); inside the module's call, so
    that ZeRO-3 gathers the weight once for all tiles."""
    if targets is None:
        return nn.functional.linear(hidden, self.weight, self.bias)
    if per_token:
        return tiled_token_logps(hidden, self.weight, targets, choice)
    if normalizer is None:
        return tiled_row_logps(hidden, self.weight, targets, choice)
    return tiled_cross_entropy(hidden, self.weight, targets, normalizer, choice)


@dataclass
class RowLogps(ModelOutput):
    """What the model returns for ``row_logps=True``: each row's summed target log-probability, fp32."""

    row_logps: torch.Tensor | None = None


@dataclass
class TokenLogps(ModelOutput):
    """What the model returns for ``token_logps=True``: each position's target log-probability and entropy."""

    token_logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _tiled_forward(
    self: nn.Module,
    *args: Any,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: Any = None,
    row_logps: bool = False,
    token_logps: bool = False,
    temperature: float = 1.0,
    **kwargs: Any,
) -> Any:
    """The causal LM's forward with the tiled loss when labels are given (``row_logps``: each row's summed target
    log-probabilities instead, :class:`RowLogps`; ``token_logps``: each position's, with the entropy, of the
    logits divided by ``temperature``, :class:`TokenLogps`); its own forward otherwise."""
    if labels is None and shift_labels is None:
        return self._untiled_forward(*args, **kwargs)
    kwargs.pop("logits_to_keep", None)
    outputs = self.get_decoder()(*args, **kwargs)
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    head = self.get_output_embeddings()
    if token_logps:
        hidden = outputs.last_hidden_state
        logps, entropy = head(
            hidden / temperature if temperature != 1 else hidden, shift_labels, None, self._tiled_loss, True
        )
        return TokenLogps(token_logps=logps, entropy=entropy)
    if row_logps:
        return RowLogps(row_logps=head(outputs.last_hidden_state, shift_labels, None, self._tiled_loss))
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum()
    normalizer = torch.as_tensor(num_items_in_batch, dtype=torch.float32)
    loss = head(outputs.last_hidden_state, shift_labels, normalizer, self._tiled_loss)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def has_tiled_loss(model: nn.Module) -> bool:
    """Whether ``model`` (a Hugging Face causal LM, or a DeepSpeed engine or peft model around one) computes its
    loss, and with ``row_logps=True`` its rows' log-probs, over the LM head in tiles."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return getattr(inner, "_tiled_loss", None) is not None


def install_tiled_loss(model: nn.Module, choice: TiledLoss) -> nn.Module:
    """Make ``model`` (a Hugging Face causal LM) compute its loss over the LM head in tiles; returns it."""
    if not choice.enabled:
        return model
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"tiled loss needs a bias-free nn.Linear LM head, got {type(head).__name__}")
    head.forward = types.MethodType(_head_forward, head)
    model._untiled_forward = model.forward
    model._tiled_loss = choice
    model.forward = types.MethodType(_tiled_forward, model)
    return model
