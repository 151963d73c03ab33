"""MoE load balancing as DeepSeek trains it, and router telemetry, for any engine (ZeRO, pipeline, layer split).

Transformers' DeepSeek-V2/V3 routers compute no balance loss and nothing updates V3's ``e_score_correction_bias``.
A :class:`Balancer` attaches forward hooks to the routers of the built model (the stages of a pipeline hold the
same modules), and adds:

- **V3's auxiliary-loss-free bias** (``bias``): each optimizer step's expert loads, counted on the device over all
  micro-batches, are summed over the whole world once (``[moe layers, experts]``; a rank fills the layers it runs,
  so under the pipeline the sum is still the global batch's load), then every rank moves each router's bias by
  ``b_i += γ·sign(mean − load_i)``: the same arithmetic on the same integers keeps the bias bit-identical everywhere.
  The bias is kept in fp32 (a bf16 bias near 1 would round a step of 0.001 away) and is a persistent buffer, so
  checkpoints and the Hugging Face export carry it.
- **Balance losses** (``aux``): V3's sequence-wise complementary loss (normalised sigmoid scores) or V2's
  expert-level loss (softmax scores; per sequence with ``seq_aux``, else per batch), times α. They enter backward
  without touching the engines' loss, as Megatron-LM's ``MoEAuxLossAutoScaler`` does: the router's gate weights
  pass through :class:`_InjectAux`, whose backward hands the loss the gradient ``scale`` = 1/accumulation steps ×
  the fp16 loss scale, exactly what DeepSpeed applies to the LM loss in ``engine.backward``.
- **Telemetry**: per-layer expert loads over each log window (``expert_load_imbalance``, ``dead_experts``,
  ``expert_load``) and the balance loss, read only at log points (the only host waits).

Under sequence parallelism (``sequence``: this rank's slice position, the group size and the group) each router
sees its rank's slice of every row. The loads need nothing more (summed over the world they are the whole rows'
loads); the balance loss all-reduces its per-sequence routed counts, score sums and token counts over the group, so
every rank's loss is the whole rows' and its gradient reaches this slice's scores only (DeepSpeed sums the group's
gradients); the real-token masks are sliced like the rows.

Only real tokens count: chat rows end in padding (:func:`real_tokens`), which is routed like any token but left out
of the loads, the bias update and both losses. The loop hands each training micro-batch through :meth:`Balancer.watch`
as the engine draws it; the ``k``-th forward of a router in a step is the step's ``k``-th micro-batch (and so is its
``k``-th recomputation in backward: ZeRO and the layer split run one micro-batch at a time, the pipeline's 1F1B
runs each stage's forwards and backwards in micro-batch order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepzero.data import IGNORE_INDEX
from deepzero.errors import UserError
from deepzero.flops import routed_experts
from deepzero.sequence_parallel import local_mask

MODES = ("auto", "bias", "aux", "both", "off")
DEFAULT_BIAS_RATE = 0.001
"""γ of the DeepSeek-V3 report (most of pre-training)."""
V3_SEQ_ALPHA = 0.0001
"""α of V3's complementary sequence-wise balance loss."""
V2_AUX_ALPHA = 0.001
"""V2-Lite's ``aux_loss_alpha``, used when a V2 config does not carry one."""
FAMILIES = {"deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2"}


@dataclass(frozen=True)
class BalanceChoice:
    """What balances the routers of this run (resolved from ``--moe-balance`` and the model family)."""

    mode: str
    """bias, aux, both or off."""
    family: str
    """model_type: deepseek_v3, deepseek_v2, or another (dense or unsupported: off)."""
    bias_rate: float = 0.0
    aux_alpha: float = 0.0
    seq_aux: bool = True
    """The loss is computed per sequence (a packed row) and averaged, else over the whole micro-batch."""
    source: str = "--moe-balance"

    @property
    def uses_bias(self) -> bool:
        return self.mode in ("bias", "both")

    @property
    def uses_aux(self) -> bool:
        return self.mode in ("aux", "both") and self.aux_alpha > 0

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        """One header line: ``moe balance: bias γ 0.001 + sequence-wise loss α 0.0001 (auto: DeepSeek-V3)``."""
        parts = []
        if self.uses_bias:
            parts.append(f"bias γ {self.bias_rate:g}")
        if self.mode in ("aux", "both"):
            kind = "sequence-wise" if self.seq_aux else "batch-wise"
            name = "complementary" if self.family == "deepseek_v3" else "expert-level"
            parts.append(f"{kind} {name} loss α {self.aux_alpha:g}")
        return f"moe balance: {' + '.join(parts) or 'off'} ({self.source})"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("mode", "family", "bias_rate", "aux_alpha", "seq_aux")}


def choose(
    config: Any, mode: str = "auto", bias_rate: float | None = None, aux_alpha: float | None = None
) -> BalanceChoice:
    """The balancing for ``config``: ``auto`` is V3 bias + sequence-wise loss, V2 its config's aux loss, else off.

    Explicit modes the model cannot do (a bias on V2's router, anything on a dense model) are one UserError.
    """
    family = str(getattr(config, "model_type", ""))
    for name, value in (("--moe-bias-rate", bias_rate), ("--moe-aux-alpha", aux_alpha)):
        if value is not None and not value >= 0:
            raise UserError(name, f"must be 0 or more, got {value}", f"pass e.g. {name} 0.001")
    if family not in FAMILIES:
        if mode in ("auto", "off"):
            return BalanceChoice("off", family, source="dense model" if not routed_experts(config) else family)
        what = "a dense model (no routed experts)" if not routed_experts(config) else f"{family}, not DeepSeek-V2/V3"
        raise UserError(f"--moe-balance {mode}", f"the model is {what}", "drop --moe-balance (auto) or pass off")
    if family == "deepseek_v2" and mode in ("bias", "both"):
        raise UserError(
            f"--moe-balance {mode}",
            "DeepSeek-V2's router has no e_score_correction_bias (the bias method is DeepSeek-V3's)",
            "use --moe-balance aux (V2's expert-level loss) or off",
        )
    source = f"auto: {FAMILIES[family]}" if mode == "auto" else f"--moe-balance {mode}"
    if family == "deepseek_v3":
        alpha = V3_SEQ_ALPHA if aux_alpha is None else aux_alpha
        rate = DEFAULT_BIAS_RATE if bias_rate is None else bias_rate
        return BalanceChoice("both" if mode == "auto" else mode, family, rate, alpha, True, source)
    alpha = float(getattr(config, "aux_loss_alpha", V2_AUX_ALPHA)) if aux_alpha is None else aux_alpha
    seq_aux = bool(getattr(config, "seq_aux", True))
    return BalanceChoice("aux" if mode == "auto" else mode, family, 0.0, alpha, seq_aux, source)


class _InjectAux(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux`` receives the gradient ``scale`` (Megatron's
    MoEAuxLossAutoScaler): the balance loss joins backward as if it had been added to the engine's loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def router_scores(logits: torch.Tensor, family: str) -> torch.Tensor:
    """Per-token affinities the balance loss uses: V3 sigmoid normalised over the experts, V2 softmax."""
    if family == "deepseek_v3":
        scores = logits.float().sigmoid()
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return logits.float().softmax(dim=-1)


def balance_loss(
    scores: torch.Tensor,
    topk: torch.Tensor,
    rows: int,
    per_sequence: bool,
    real: torch.Tensor | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Σ_i f_i·P_i (without α): f_i = E/(K·T)·(tokens routed to i), P_i = mean score of i over the T tokens;
    per sequence (``rows`` sequences, averaged over those with a real token) or over all tokens. ``real`` (one bool
    per token, None: all) leaves padding out: T counts real tokens only. 1 when perfectly balanced. With a sequence
    ``group`` the tokens are this rank's slices of the rows: the sums are the group's (the value is the whole rows'
    loss on every rank; its gradient reaches this rank's scores only)."""
    tokens, experts = scores.shape
    groups = rows if per_sequence else 1
    k = topk.shape[1]
    weight = torch.ones(tokens, device=scores.device) if real is None else real.to(scores.device).float()
    weight = weight.reshape(groups, -1)  # [groups, T]
    count = weight.sum(dim=1, keepdim=True)
    f = torch.zeros(groups, experts, device=scores.device, dtype=scores.dtype)
    f.scatter_add_(1, topk.reshape(groups, -1), weight.repeat_interleave(k, dim=1).to(scores.dtype))
    p = (scores.reshape(groups, -1, experts) * weight.unsqueeze(-1)).sum(dim=1)
    if group is not None:
        f, count, p = _group_sums(f, count, p, group)
    f = f * experts / (k * count.clamp(min=1))
    p = p / count.clamp(min=1)
    seen = (count.squeeze(1) > 0).to(scores.dtype)  # a sequence of padding only has no loss (no host read)
    return ((f * p).sum(dim=1) * seen).sum() / seen.sum().clamp(min=1)


def _group_sums(
    f: torch.Tensor, count: torch.Tensor, p: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequence group's sums of the routed counts, token counts and score sums; the score sum stays
    differentiable in this rank's own part (the others' parts enter as constants)."""
    total = torch.cat([f, count.to(f.dtype), p.detach()], dim=1)
    dist.all_reduce(total, group=group)
    experts = f.shape[1]
    f, count = total[:, :experts], total[:, experts : experts + 1]
    return f, count, p + (total[:, experts + 1 :] - p.detach())


def padding_id(meta: dict[str, Any]) -> int | None:
    """The id chat and preference rows are padded with (the tokenizer's pad, else its eos); None for text
    rows, which are never padded."""
    if meta.get("format") not in ("chat", "preference"):
        return None
    pad = meta.get("pad_token_id")
    return meta.get("eos_token_id") if pad is None else pad


def real_tokens(batch: dict[str, torch.Tensor], pad_id: int | None) -> torch.Tensor | None:
    """``[rows, seq]`` bools, False on padding (None: every position is real). A chat row is whole conversations
    then padding up to its length, so padding is the row's final run of ``pad_id``, less any position that is a
    training target (an eos closing the last answer, when the pad id is eos). Prompt tokens are real. On the device,
    no host read."""
    if pad_id is None:
        return None
    ids = batch["input_ids"]
    tail = (ids == pad_id).flip(-1).cumprod(dim=-1).flip(-1).bool()  # from the last non-pad token to the end
    target = torch.zeros_like(tail)
    labels = batch.get("labels")
    if labels is not None:  # input t is row[t]; labels[t - 1] is row[t] unless not a target
        target[:, 1:] = labels[:, :-1] != IGNORE_INDEX
    return ~(tail & ~target)


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The DeepSeek routers (``mlp.gate``) in model order: modules with ``top_k``, ``num_experts`` and a weight."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopkRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


_UNCOUNTED: ContextVar[bool] = ContextVar("deepzero_moe_uncounted", default=False)


@contextmanager
def uncounted() -> Iterator[None]:
    """Forwards inside are not training tokens (a preference run's reference pass with the LoRA adapters off, run
    in train mode): the routers' hooks neither count them nor add a balance loss, nor take a micro-batch's mask."""
    token = _UNCOUNTED.set(True)
    try:
        yield
    finally:
        _UNCOUNTED.reset(token)


def in_backward() -> bool:
    """True while autograd runs backward: activation checkpointing recomputes a forward there (not a new one)."""
    return torch._C._current_graph_task_id() != -1


class Balancer:
    """Hooks on every router of ``model``: load counts and balance losses on the device, the V3 bias update after
    each optimizer step (:meth:`after_step`, every rank) and the window's telemetry (:meth:`window_stats`, every
    rank, at log points only).

    ``grad_scale()`` is what the engine multiplies the loss by before backward (1/accumulation steps × the fp16 loss
    scale); it is read once per router call.
    """

    def __init__(
        self,
        model: nn.Module,
        choice: BalanceChoice,
        grad_scale: Callable[[], float],
        device: torch.device | str,
        group: Any = None,
        sequence: Any = None,
    ) -> None:
        self.choice = choice
        self.sequence = sequence
        """Sequence parallelism's groups (``sequence_parallel.SequenceGroups``: rank, size, group); None: whole rows."""
        self.routers = find_routers(model)
        self.grad_scale = grad_scale
        self.group = group
        n = len(self.routers)
        experts = self.routers[0].num_experts if self.routers else 0
        self.device = torch.device(device)
        self.step_counts = torch.zeros(n, experts, dtype=torch.int64, device=self.device)
        self.window_counts = torch.zeros_like(self.step_counts)
        self.window_global = True
        """window_counts already holds the whole world's loads (summed each step for the bias)."""
        self.loss_sum = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.loss_calls = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.step_tokens: list[torch.Tensor | None] = []
        """The real-token masks of this step's micro-batches, in the order the engine drew them (:meth:`watch`)."""
        self._calls = [[0, 0] for _ in range(n)]  # per router: forwards, recomputations in backward this step
        self._handles = []
        for index, router in enumerate(self.routers):
            if choice.uses_bias:
                keep_bias_fp32(router)
            self._handles.append(router.register_forward_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[..., Any]:
        choice = self.choice

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not (module.training or torch.is_grad_enabled()) or _UNCOUNTED.get():  # evaluation, export checks,
                return None  # a reference pass
            logits, weights, topk = output
            real = self._real(index, topk.shape[0])
            if not in_backward():  # a recomputation (activation checkpointing) is not new tokens
                idx = topk.reshape(-1).to(self.device, non_blocking=True)
                ones = torch.ones_like(idx) if real is None else real.to(self.device).repeat_interleave(topk.shape[1])
                self.step_counts[index].index_add_(0, idx, ones.to(idx.dtype))
            if not choice.uses_aux:
                return None
            rows = args[0].shape[0] if args[0].dim() == 3 else 1
            scores = router_scores(logits, choice.family)
            seq_group = self.sequence.group if self.sequence is not None else None
            aux = choice.aux_alpha * balance_loss(scores, topk, rows, choice.seq_aux, real, seq_group)
            if not in_backward():
                self.loss_sum[index] += aux.detach().to(self.device, non_blocking=True)
                self.loss_calls[index] += 1
            if not aux.requires_grad:
                return None
            return logits, _InjectAux.apply(weights, aux, float(self.grad_scale())), topk

        return hook

    def watch(
        self, batches: Iterator[dict[str, torch.Tensor]], pad_id: int | None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The training micro-batches, unchanged; each one's :func:`real_tokens` is noted as the engine draws it."""
        try:
            for batch in batches:
                real = real_tokens(batch, pad_id)
                if real is None and self.sequence is not None:  # its padding (sequence_parallel.shard) is not real
                    real = torch.ones_like(batch["input_ids"], dtype=torch.bool)
                self.step_tokens.append(real)
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # closing the loop's iterator stops the data loader's worker

    def _real(self, index: int, tokens: int) -> torch.Tensor | None:
        """The real-token mask of this router call: the step's ``k``-th micro-batch for its ``k``-th forward (or
        ``k``-th recomputation); None (all real) when no micro-batch was noted for it."""
        calls = self._calls[index]
        which = int(in_backward())
        k = calls[which]
        calls[which] += 1
        if k >= len(self.step_tokens) or self.step_tokens[k] is None:
            return None
        real = self.step_tokens[k]
        if self.sequence is not None:  # the router sees this rank's part of every (padded) row
            real = local_mask(real, self.sequence.rank, self.sequence.size)
        real = real.reshape(-1)
        if real.numel() != tokens:
            raise RuntimeError(f"router {index}: call {k} routes {tokens} tokens, micro-batch {k} has {real.numel()}")
        return real

    def after_step(self) -> None:
        """After each optimizer step, on every rank: the step's loads into the window; with the bias, summed over
        the world once and every router's bias moved toward balance (no host wait)."""
        self.step_tokens.clear()
        for calls in self._calls:
            calls[:] = [0, 0]
        if not self.routers:
            return
        if self.choice.uses_bias:
            counts = self.step_counts
            if dist.is_initialized():
                dist.all_reduce(counts, group=self.group)
            update_biases(self.routers, counts, self.choice.bias_rate)
        else:
            self.window_global = not dist.is_initialized()
        self.window_counts += self.step_counts
        self.step_counts.zero_()

    def window_stats(self) -> dict[str, Any]:
        """The log window's router telemetry (a collective without the bias; waits for the device), then reset."""
        if not self.routers:
            return {}
        counts, loss = self.window_counts, torch.stack([self.loss_sum, self.loss_calls.float()])
        if dist.is_initialized():  # one all-reduce: the loads (unless summed each step already) with the losses
            local = [loss.double()] if self.window_global else [counts.double(), loss.double()]
            summed = torch.cat([t.reshape(-1) for t in local])
            dist.all_reduce(summed, group=self.group)
            if not self.window_global:
                counts = summed[: counts.numel()].reshape(counts.shape).to(counts.dtype)
            loss = summed[-loss.numel() :].reshape(loss.shape).float()
        stats = load_stats(counts.cpu())
        if self.choice.uses_aux:
            stats["balance_loss"] = float((loss[0] / loss[1].clamp(min=1)).sum())
        self.window_counts.zero_()
        self.loss_sum.zero_()
        self.loss_calls.zero_()
        self.window_global = True
        return stats

    def biases(self) -> torch.Tensor:
        """Every router's correction bias, ``[moe layers, experts]`` (fp32, on the CPU): for checks and tests."""
        return torch.stack([r.e_score_correction_bias.detach().float().cpu() for r in self.routers])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def keep_bias_fp32(router: nn.Module) -> None:
    """Keep ``e_score_correction_bias`` in fp32 (the engine may have cast the model to bf16/fp16); the router adds
    it to fp32 scores anyway, and Transformers keeps it in fp32 on load (``_keep_in_fp32_modules_strict``)."""
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        raise UserError(type(router).__name__, "has no e_score_correction_bias", "use --moe-balance aux or off")
    if bias.dtype != torch.float32:
        router.e_score_correction_bias = bias.detach().float()


@torch.no_grad()
def update_biases(routers: list[nn.Module], counts: torch.Tensor, rate: float) -> None:
    """``b_i += rate · sign(mean load − load_i)`` per router, from the global counts ``[layers, experts]``."""
    loads = counts.float()
    step = rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for router, delta in zip(routers, step, strict=True):
        bias = router.e_score_correction_bias
        bias += delta.to(bias.device, bias.dtype, non_blocking=True)


def load_stats(counts: torch.Tensor) -> dict[str, Any]:
    """``expert_load_imbalance`` (max/mean tokens per expert, averaged over layers), ``dead_experts`` (experts
    with no token) and ``expert_load`` (each layer's loads relative to its mean) from ``[layers, experts]``."""
    loads = counts.double()
    mean = loads.mean(dim=1, keepdim=True)
    seen = mean.squeeze(1) > 0
    if not bool(seen.any()):
        return {}
    relative = loads[seen] / mean[seen]
    return {
        "expert_load_imbalance": float(relative.max(dim=1).values.mean()),
        "dead_experts": int((counts[seen] == 0).sum()),
        "expert_load": [[round(float(v), 3) for v in row] for row in relative],
    }


def attach(
    model: nn.Module, choice: BalanceChoice, grad_scale: Callable[[], float], device: Any, sequence: Any = None
) -> Balancer | None:
    """A Balancer on the routers of a DeepSeek-V2/V3 ``model`` (telemetry also when balancing is off), else None;
    ``sequence``: the engine's sequence-parallel groups, if any."""
    if choice.family not in FAMILIES or not find_routers(model):
        return None
    return Balancer(model, choice, grad_scale, device, sequence=sequence)
