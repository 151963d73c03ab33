"""The exports' logit round trip, judged on every token: the merged export against the adapters applied unmerged (the
16-bit LoRA engine, or the 16-bit base with the adapter folder applied by peft).

Per token the gap is the largest |Δlogit| over the vocabulary; the record gives its maximum, 99th percentile and
median over the probe's tokens. The check passes when every token is within a tolerance scaled to the export dtype
(``ULPS`` units of its precision at the logits' scale: ``deepzero.precision.logit_tolerance``), so the maximum and
the 99th percentile are. Each MoE router's top-k choice is recorded in both forwards (:func:`routing_recorded`): a
token whose choice differs is a near-tie flip when, at the first router where it differs, the two routers' weights
and routing biases agree to the dtype's rounding and the token's own perturbation there explains the flip: the
selection margin between the experts that swapped is at most twice the largest change of an expert's score
(:func:`routing_flips`). A margin, not a bound on the perturbation: over many layers the hidden states' rounding
moves a deep router's logits by more than any fixed number of units, and a flip on a near-tie is then still a tie.
Any other flip (a routing bias left out of the adapter folder, another router weight) fails the check even where it
barely moves the logits. A near-tie flip sends the token to other experts and may move its logits by far more: such
tokens are exempt from the tolerance and counted in the record. How many there are is not bounded: it depends on
the router (a tiny random one has near-ties everywhere) and on the CPU's rounding, not on the export; each one is
checked to be a tie.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepzero.adapters.peft_compat import load_adapter
from deepzero.precision import logit_tolerance

ULPS = 32.0
"""Units of the export dtype's precision at the logits' scale (at least 1) that a token's gap may reach. Measured on
the tiny DeepSeek-V2/V3 and Llama of tests/test_adapter_merge.py (bf16, r4 adapters on attn + mlp, 128 tokens): up
to 18 units, the merged weights' rounding carried through every layer; one lora_B doubled moves them by 60-120. fp32
also gets ``logit_tolerance``'s 1e-4 floor."""
CROSS_DEVICE_ULPS = 64.0
"""The same for an engine that ran on a GPU against its export reloaded on the CPU (other kernels, other sums)."""


@dataclass(frozen=True)
class Route:
    """One MoE router's call: its logits [tokens, experts] (fp32), chosen experts [tokens, k], routing bias, weight
    [experts, hidden] (fp32; None where the call's weight was not whole, as under ZeRO-3 partitioning) and ``groups``:
    the number of expert groups where the router limits its choice to some of them (1: not group-limited)."""

    logits: torch.Tensor
    chosen: torch.Tensor
    bias: torch.Tensor | None
    weight: torch.Tensor | None = None
    groups: int = 1


def limited_groups(router: torch.nn.Module) -> int:
    """The expert groups a Transformers DeepSeek-style router picks its experts in: ``num_group`` where it keeps only
    ``topk_group`` of them (V3 always, V2 with ``topk_method="group_limited_greedy"``), else 1."""
    groups, kept = getattr(router, "num_group", None) or 1, getattr(router, "topk_group", None)
    limited = kept is not None and kept < groups and getattr(router, "topk_method", None) != "greedy"
    return groups if limited else 1


@contextmanager
def routing_recorded() -> Iterator[list[Route]]:
    """Every MoE router's call (a module named ``*Router`` returning logits, weights and top-k indices, as
    Transformers' DeepSeek-V2/V3 routers do) in call order, while the block runs, in any model of this process."""
    calls: list[Route] = []

    def record(module: torch.nn.Module, args: object, output: object) -> None:
        if not type(module).__name__.endswith("Router") or not isinstance(output, tuple) or len(output) != 3:
            return
        logits, _, chosen = output
        if isinstance(chosen, torch.Tensor) and not chosen.is_floating_point():
            bias, weight = getattr(module, "e_score_correction_bias", None), getattr(module, "weight", None)
            bias = None if bias is None else bias.detach().float().cpu()
            whole = isinstance(weight, torch.Tensor) and weight.dim() == 2 and len(weight) == logits.shape[-1]
            weight = weight.detach().float().cpu() if whole else None
            groups = limited_groups(module)
            calls.append(Route(logits.detach().float().cpu(), chosen.detach().cpu(), bias, weight, groups))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield calls
    finally:
        handle.remove()


def selection_scores(route: Route) -> torch.Tensor:
    """The per-expert scores [tokens, experts] ``route``'s router ranks its experts by: sigmoid(logits) + bias for a
    router with a routing bias (Transformers' DeepSeek-V3 ``scores_for_choice``), else softmax(logits) (DeepSeek-V2;
    any router that ranks by a per-token increasing function of its logits ranks the same)."""
    if route.bias is not None:
        return route.logits.sigmoid() + route.bias
    return route.logits.softmax(-1)


def same_to_rounding(a: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> bool:
    """Whether two routing biases (or router weights) agree to ``eps``'s rounding; absent from both counts as equal."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool((a - b).abs().max() <= 2 * eps * max(float(a.abs().max()), eps))


def swap_margin(ref: Route, other: Route, scores: torch.Tensor) -> torch.Tensor:
    """Per token, in ``ref``'s selection ``scores``: the weakest expert only ``ref`` chose minus the strongest only
    ``other`` chose (+inf where the choices agree). Both choices are the top-k of their own scores, so a flip that
    the scores' change explains has a margin of at most twice that change. For a group-limited router that holds
    only where both choices lie in the same groups (both are then the top-k of those groups); a flip between groups
    is decided on the groups' scores, which per-expert scores do not measure: its margin is 0 (the weights and
    biases are still compared)."""
    ours = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ref.chosen, True)
    theirs = torch.zeros_like(ours).scatter_(-1, other.chosen, True)
    weakest = scores.masked_fill(~(ours & ~theirs), math.inf).amin(-1)
    strongest = scores.masked_fill(~(theirs & ~ours), -math.inf).amax(-1)
    margin = weakest - strongest
    experts = scores.shape[-1]
    if ref.groups > 1 and experts % ref.groups == 0:
        size = experts // ref.groups
        groups = (ours.view(-1, ref.groups, size).any(-1) != theirs.view(-1, ref.groups, size).any(-1)).any(-1)
        margin = margin.masked_fill(groups, 0.0)
    return margin


def routing_flips(ref: list[Route], other: list[Route], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether its top-k choice differs between the two forwards, and whether that is a near-tie, judged
    at the first router where it differs, for a model in ``dtype``: the routers' weights and routing biases agree to
    the dtype's rounding, and the swap's margin in the reference's selection scores (:func:`swap_margin`) is at most
    twice the token's largest score change there (max over experts of |Δscore|), plus 4 units of the dtype's
    precision at the token's scores (the router may round its scores to the dtype: 2 units bound that). The scores
    are the router's own (:func:`selection_scores`), each forward's with its own bias, so the change includes every
    difference of the inputs however many layers it grew over: no fixed bound that a near-tie could cross. Calls
    that record no whole weight (ZeRO-3 partitions) skip the weight comparison. No routers (a dense model), or
    calls that do not pair up: none."""
    tokens = ref[0].chosen.shape[0] if ref else 0
    paired = len(ref) == len(other) and all(a.chosen.shape == b.chosen.shape for a, b in zip(ref, other, strict=False))
    if not ref or not paired or any(a.chosen.shape[0] != tokens for a in ref):
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool)
    eps = torch.finfo(dtype).eps
    flipped = torch.zeros(tokens, dtype=torch.bool)
    ties = torch.zeros(tokens, dtype=torch.bool)
    for a, b in zip(ref, other, strict=True):
        here = (a.chosen.sort(-1).values != b.chosen.sort(-1).values).any(-1) & ~flipped
        if here.any() and same_to_rounding(a.bias, b.bias, eps):
            weights = a.weight is None or b.weight is None or same_to_rounding(a.weight, b.weight, eps)
            scores = selection_scores(a)
            change = (scores - selection_scores(b)).abs().amax(-1)
            floor = 4 * eps * scores.abs().amax(-1)
            ties |= here & weights & (swap_margin(a, b, scores) <= 2 * change + floor)
        flipped |= here
    return flipped, ties


def tolerance_for(dtype: torch.dtype, reference: torch.Tensor, same_device: bool = True) -> float:
    """A token's allowed gap for an export in ``dtype`` compared with ``reference`` logits."""
    return logit_tolerance(dtype, reference, ULPS if same_device else CROSS_DEVICE_ULPS)


@dataclass(frozen=True, kw_only=True)
class TokenGaps:
    """The per-token figures of the logit round trip (a report's fields; ``max_abs_logit_diff``, ``tolerance`` and
    ``dtype`` are the report's own). Zero tokens compared: not checked."""

    p99_token_logit_diff: float | None = None
    median_token_logit_diff: float | None = None
    tokens_compared: int = 0
    tokens_over_tolerance: int = 0
    routing_flips: int = 0
    """Tokens whose top-k experts differ between the two forwards (at any MoE layer)."""
    near_tie_flips: int = 0
    """Of those, the flips on a near-tie (every flip must be one)."""
    exempt_tokens: int = 0
    """Tokens over the tolerance that are near-tie flips."""

    @property
    def logits_ok(self) -> bool:
        over, exempt = self.tokens_over_tolerance, self.exempt_tokens
        ties_only = self.routing_flips == self.near_tie_flips
        return ties_only and over == exempt

    def logits_why(self, against: str) -> str:
        """What failed in the logit round trip, in one line."""
        tokens, flips, ties = self.tokens_compared, self.routing_flips, self.near_tie_flips
        routing = f"; {flips - ties} of {tokens} tokens chose other experts, not on a near-tie" if flips > ties else ""
        exempt = f", {self.exempt_tokens} of them near-tie flips (exempt)"
        return (
            f"{against}: {self.tokens_over_tolerance} of {tokens} tokens over tolerance {self.tolerance:.3g}"
            f" ({self.dtype}){exempt if self.exempt_tokens else ''}{routing}; per-token max |Δlogit| max"
            f" {self.max_abs_logit_diff:.3g}, p99 {self.p99_token_logit_diff:.3g}, median"
            f" {self.median_token_logit_diff:.3g}"
        )


def token_gaps(
    diff: torch.Tensor, tolerance: float, flips: tuple[torch.Tensor, torch.Tensor] | None = None
) -> dict[str, float | int]:
    """:class:`TokenGaps`' fields (and ``max_abs_logit_diff``) for |Δlogit| ``diff`` [..., tokens, vocab];
    ``flips``: :func:`routing_flips` over the same tokens (None or empty: no routers)."""
    per_token = diff.float().amax(-1).flatten()
    over = per_token > tolerance
    flipped, ties = flips if flips is not None else (over[:0], over[:0])
    if flipped.numel() != per_token.numel():
        flipped = ties = torch.zeros_like(over)
    return {
        "max_abs_logit_diff": per_token.max().item(),
        "p99_token_logit_diff": per_token.quantile(0.99).item(),
        "median_token_logit_diff": per_token.median().item(),
        "tokens_compared": per_token.numel(),
        "tokens_over_tolerance": int(over.sum()),
        "routing_flips": int(flipped.sum()),
        "near_tie_flips": int(ties.sum()),
        "exempt_tokens": int((over & ties).sum()),
    }


@torch.no_grad()
def round_trip_logits(
    out: Path, source: str, adapted: set[str], adapter_dir: Path, input_ids: torch.Tensor, attn: str
) -> tuple[dict[str, Any], str]:
    """The merged folder's logits against the source's with the adapter folder applied by stock peft (unmerged),
    both in the files' dtype, per token (:func:`token_gaps`, the tolerance), and what peft did with the folder.
    Where stock peft wraps other modules than were adapted (its transformers-4 → 5 rewrite of MoE targets,
    huggingface/peft#3711), the comparison loads the folder as ``peft_compat.load_adapter`` does and the note says
    so."""
    import peft
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out, dtype="auto", attn_implementation=attn).eval()
    with routing_recorded() as merged_routes:
        logits = merged(input_ids=input_ids).logits.float()
    dtype = merged.dtype
    del merged
    base = AutoModelForCausalLM.from_pretrained(source, dtype="auto", attn_implementation=attn)
    unmerged = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    wrapped = {n for n, m in unmerged.get_base_model().named_modules() if hasattr(m, "lora_A")}
    note = f"stock peft {peft.__version__} loads it as trained"
    if wrapped != adapted:
        note = (
            f"stock peft {peft.__version__} wraps {len(wrapped & adapted)} of the {len(adapted)}"
            " adapted modules (its MoE target rewrite, huggingface/peft#3711): load the folder with"
            " deepzero.adapters.peft_compat.load_adapter, or load the merged folder"
        )
        base = AutoModelForCausalLM.from_pretrained(source, dtype="auto", attn_implementation=attn)
        unmerged = load_adapter(base, adapter_dir).eval()
    with routing_recorded() as unmerged_routes:
        reference = unmerged(input_ids=input_ids).logits.float()
    tolerance = tolerance_for(dtype, reference)
    gaps = token_gaps((logits - reference).abs(), tolerance, routing_flips(unmerged_routes, merged_routes, dtype))
    return gaps | {"tolerance": tolerance}, note
