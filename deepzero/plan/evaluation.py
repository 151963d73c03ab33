"""Evaluation and sampling on the cards (``--evaluate``): ``evaluate.py`` and ``sample.py`` generate with
Transformers' ``generate``, all the rows of a copy of the model in one call, and train nothing.

``plan_evaluation`` picks how the cards hold the model, fastest first: a whole copy on every card (data parallel,
each rank its share of the prompts), else one copy's decoder layers split over the cards (``deepzero.placement``'s
device_map); each in 16 bits, else with the base in NF4 (bitsandbytes, as ``--load-in-4bit`` loads it). A card holds
its weights, the KV cache of its layers for the rows at prompt + completion tokens, and while it computes, the
prefill's largest layer and (the card with the LM head) the last position's logits: the terms GRPO's rollouts count
(``plan.generation``), and the CUDA context and fragmentation every estimate adds (``plan.memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepzero.adapters import quant
from deepzero.errors import UserError
from deepzero.modeling import planning_config
from deepzero.plan.arch import ModelStats, model_stats
from deepzero.plan.generation import kv_layer_bytes, prefill_bytes, sampling_logits_bytes
from deepzero.plan.memory import CUDA_RESERVE, FRAGMENTATION, GiB, dequantised_bytes, gib
from deepzero.plan.setup import Setup
from deepzero.plan.tables import format_table

MODES = ("data-parallel", "placement", "data-parallel-4bit", "placement-4bit")
"""The ways to hold the model, in the order ``plan_evaluation`` prefers them."""
DOES_NOT_FIT = "does-not-fit"
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""The model's dtype (a 4-bit base's compute dtype) and its bytes per value."""


@dataclass(frozen=True)
class CardBytes:
    """What one card of a copy holds while the copy generates its rows."""

    layers: range
    """The decoder layers on the card (all of them for a whole copy)."""
    weights: int
    """Its weights as loaded: 16-bit, or a 4-bit base's NF4 codes and constants with the rest in 16 bits."""
    kv_cache: int
    """Its layers' KV cache of the rows at prompt + completion tokens."""
    working: int
    """The prefill's largest layer over the rows' prompts, and for a 4-bit base one weight (or a MoE layer's fused
    experts) dequantised to the compute dtype (its load moves each tensor through the card in 16 bits: no more)."""
    logits: int
    """The last position's logits and sampling probabilities, on the card with the LM head; else 0."""

    @property
    def allocated(self) -> int:
        return self.weights + self.kv_cache + self.working + self.logits

    @property
    def total(self) -> int:
        """What the card must have: ``allocated`` plus the CUDA context and fragmentation (``Estimate.gpu_total``)."""
        return self.allocated + CUDA_RESERVE + int(FRAGMENTATION * self.allocated)


@dataclass(frozen=True)
class EvalPlan:
    """How ``evaluate.py`` and ``sample.py`` run on the cards."""

    mode: str
    """One of ``MODES`` or ``does-not-fit``."""
    weights_dtype: str
    """bf16, fp16 (fp32) or nf4."""
    rows_per_call: int
    """Rows (prompt × sample) one copy generates in one call: the most that fit, at most the ``most_rows`` asked."""
    per_card_bytes: int
    """The fullest card at ``rows_per_call`` rows (``CardBytes.total``); does-not-fit: at one row, NF4 split."""
    copies: int
    """Copies of the model: one per card (data parallel), 1 (placement), 0 (does not fit)."""
    reason: str
    """One sentence: why this mode."""

    @property
    def allocated_bytes(self) -> int:
        """The fullest card without the CUDA context and fragmentation: what ``torch.cuda.max_memory_allocated``
        counts."""
        return int((self.per_card_bytes - CUDA_RESERVE) / (1 + FRAGMENTATION))

    def describe(self) -> str:
        """One line for a header."""
        if self.mode == DOES_NOT_FIT:
            return f"does not fit: {self.reason}"
        copies = f"{self.copies} cop{'y' if self.copies == 1 else 'ies'}"
        return (
            f"{self.mode}: {copies}, {self.weights_dtype} weights, {self.rows_per_call:,} rows per call per copy,"
            f" {gib(self.per_card_bytes)} GiB on the fullest card"
        )


def unit_bytes(stats: ModelStats, dtype: str, four_bit: bool) -> tuple[int, ...]:
    """Bytes of [embedding, decoder layer 0 .. L-1, final norm + lm_head] (``ModelStats.stage_numels``) as loaded:
    every weight in ``dtype``, or under ``four_bit`` the weights ``ModelStats.four_bit_mask`` marks as NF4 codes and
    their constants (``quant.packed_bytes``, ``quant.quant_state_bytes``: what ``plan.memory`` counts for QLoRA)."""
    p = DTYPES[dtype]
    each = [
        quant.packed_bytes(n) + quant.quant_state_bytes(n) if four_bit and q else p * n
        for n, q in zip(stats.param_numels, stats.four_bit_mask or (False,) * len(stats.param_numels), strict=True)
    ]
    out, i = [], 0
    for numel in stats.stage_numels:  # model.parameters() runs embedding, layers, norm, head: one unit after another
        held = size = 0
        while held < numel:
            held, size, i = held + stats.param_numels[i], size + each[i], i + 1
        if held != numel:
            raise AssertionError(f"{stats.name}: parameters do not line up with its layers")
        out.append(size)
    return tuple(out)


def _layer_cuts(load: Callable[[int, int, int], int], cards: int, layers: int) -> tuple[int, ...]:
    """``cards`` + 1 cut points over the layers, card k holding ``cuts[k]:cuts[k+1]``, with the fullest card's
    ``load(k, lo, hi)`` as small as it can be: ``placement.plan_placement``'s split over equal cards."""
    best = [load(0, 0, j) for j in range(layers + 1)]
    back: list[list[int]] = []
    for k in range(1, cards):
        row, arg = [], []
        for j in range(layers + 1):
            i = min(range(j + 1), key=lambda i, j=j: max(best[i], load(k, i, j)))
            row.append(max(best[i], load(k, i, j)))
            arg.append(i)
        best = row
        back.append(arg)
    cuts = [layers]
    for arg in reversed(back):
        cuts.append(arg[cuts[-1]])
    return (0, *reversed(cuts))


def card_bytes(
    stats: ModelStats,
    cards: int,
    rows: int,
    prompt_len: int,
    completion_len: int,
    dtype: str = "bf16",
    four_bit: bool = False,
) -> tuple[CardBytes, ...]:
    """What each card of one copy of the model holds while it generates ``rows`` rows: the whole copy on one card
    (``cards`` 1), or its decoder layers split over ``cards`` cards (the embedding on the first, the final norm and
    LM head on the last, an LM head tied to the embedding on the first), each card's KV cache its layers' share."""
    p, layers = DTYPES[dtype], stats.arch.layers
    units = unit_bytes(stats, dtype, four_bit)
    kv = kv_layer_bytes(stats, rows, prompt_len + completion_len, p)
    working = prefill_bytes(stats, rows, prompt_len, p)
    if four_bit:  # inference keeps nothing for backward: as checkpointing, one layer's weights dequantised at a time
        working += dequantised_bytes(stats, Setup(stage=0, world_size=1, precision=dtype, checkpointing=True))
    logits = sampling_logits_bytes(stats, rows, p)
    head = 0 if stats.embedding == stats.stage_numels[0] else cards - 1  # a tied LM head sits with the embedding
    prefix = [0]
    for size in units[1:-1]:
        prefix.append(prefix[-1] + size)

    def card(k: int, lo: int, hi: int) -> CardBytes:
        weights = prefix[hi] - prefix[lo] + units[0] * (k == 0) + units[-1] * (k == cards - 1)
        return CardBytes(range(lo, hi), weights, (hi - lo) * kv, working * (hi > lo), logits * (k == head))

    cuts = _layer_cuts(lambda k, lo, hi: card(k, lo, hi).total, cards, layers)
    return tuple(card(k, cuts[k], cuts[k + 1]) for k in range(cards))


def plan_evaluation(
    model: str,
    gpus: int,
    gpu_mem_gb: float,
    prompt_len: int,
    completion_len: int,
    most_rows: int,
    dtype: str = "bf16",
) -> EvalPlan:
    """How to generate ``prompt_len`` + ``completion_len`` tokens per row with ``model`` (a preset, a folder with
    config.json or a hub id: its config only) on ``gpus`` cards of ``gpu_mem_gb`` GiB, at most ``most_rows`` rows a
    call (``plan_evaluation_of``)."""
    name, config = planning_config(model)
    return plan_evaluation_of(model_stats(config, name), gpus, gpu_mem_gb, prompt_len, completion_len, most_rows, dtype)


def plan_evaluation_of(
    stats: ModelStats,
    gpus: int,
    gpu_mem_gb: float,
    prompt_len: int,
    completion_len: int,
    most_rows: int,
    dtype: str = "bf16",
) -> EvalPlan:
    """The first of ``MODES`` where one row at full length fits every card, with the most rows (at most
    ``most_rows``) that fit; placement only over more than one card. ``does-not-fit`` says what the last try needs."""
    if dtype not in DTYPES:
        raise UserError("--dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    for flag, value in (("--gpus", gpus), ("--prompt-len", prompt_len), ("--completion-len", completion_len)):
        if value < 1:
            raise UserError(flag, f"{value}: must be at least 1", "pass a positive number")
    if most_rows < 1:
        raise UserError("most rows", f"{most_rows}: must be at least 1", "pass a positive number")
    budget, tokens = gpu_mem_gb * GiB, prompt_len + completion_len
    why: list[str] = []
    last = 0
    for mode in MODES if gpus > 1 else MODES[::2]:
        four_bit, cards = mode.endswith("4bit"), gpus if mode.startswith("placement") else 1
        label = "nf4" if four_bit else dtype
        weights = sum(unit_bytes(stats, dtype, four_bit))

        def at(rows: int, cards: int = cards, four_bit: bool = four_bit) -> tuple[CardBytes, ...]:
            return card_bytes(stats, cards, rows, prompt_len, completion_len, dtype, four_bit)

        one = at(1)
        fullest = max(one, key=lambda c: c.total)
        if fullest.total > budget:
            if cards == 1:
                short = "do not fit" if weights > budget else f"leave no room for a row of {tokens:,} tokens on"
                why.append(f"{label} weights {gib(weights)} GiB {short} one {gpu_mem_gb:g} GiB card")
            else:
                why.append(
                    f"split over {cards} cards the fullest needs {gib(fullest.total)} GiB at one row of {tokens:,}"
                    " tokens"
                )
            last = fullest.total
            continue
        rows = _most_rows(lambda n: max(c.total for c in at(n)) <= budget, most_rows)
        held = at(rows)
        fullest = max(held, key=lambda c: c.total)
        room = f"{gib(budget - fullest.weights)} GiB"
        kv = f"the KV cache ({fullest.kv_cache // rows / 2**20:,.0f} MiB a row) and working memory"
        if cards == 1:
            chosen = (
                f"{label} weights {gib(weights)} GiB fit one {gpu_mem_gb:g} GiB card and leave {room} of it for {kv}"
            )
            chosen += f"; each of the {gpus} cards runs a whole copy" if gpus > 1 else ""
        else:
            spans = ", ".join(f"{c.layers.start}-{c.layers.stop - 1}" if c.layers else "none" for c in held)
            chosen = f"split over {cards} cards (layers {spans}) they leave {room} on the fullest card for {kv}"
        capped = " (the most asked)" if rows == most_rows else ""
        reason = "; ".join([*why, f"{chosen}: {rows:,} rows{capped} of {tokens:,} tokens a call"]) + "."
        return EvalPlan(mode, label, rows, fullest.total, gpus if cards == 1 else 1, reason)
    reason = "; ".join(why) + f": nothing fits one row of {prompt_len:,} + {completion_len:,} tokens."
    return EvalPlan(DOES_NOT_FIT, "nf4", 0, last, 0, reason)


def _most_rows(fits: Callable[[int], bool], most: int) -> int:
    """The most rows, 1..``most``, that ``fits`` (what a card holds grows with the rows: bisect); 1 fits."""
    low, high = 1, most
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def render_evaluation(
    stats: ModelStats,
    gpus: int,
    gpu_mem_gb: float,
    prompt_len: int,
    completion_len: int,
    most_rows: int,
    dtype: str = "bf16",
    samples: int | None = None,
) -> str:
    """``--evaluate``: the plan, what each card of a copy holds, and with ``samples`` (k) the prompts one call takes."""
    plan = plan_evaluation_of(stats, gpus, gpu_mem_gb, prompt_len, completion_len, most_rows, dtype)
    lines = [
        f"{stats.name}: evaluation / sampling on {gpus} × {gpu_mem_gb:g} GiB, rows of {prompt_len:,} prompt +"
        f" {completion_len:,} completion tokens, at most {most_rows:,} rows a call",
        "",
    ]
    if plan.mode == DOES_NOT_FIT:
        return "\n".join([*lines, f"mode              {plan.mode}", f"why               {plan.reason}"])
    prompts = ""
    if samples:
        prompts = f"{plan.rows_per_call // samples:,} ({plan.rows_per_call:,} rows // {samples} samples)"
        if plan.rows_per_call < samples:
            prompts += f"; a prompt's {samples} samples take {-(-samples // plan.rows_per_call)} calls"
    fields = [
        ("mode", plan.mode),
        ("weights", plan.weights_dtype),
        ("copies", f"{plan.copies} ({'one per card' if plan.mode.startswith('data') else f'over {gpus} cards'})"),
        ("rows per call", f"{plan.rows_per_call:,} (per copy)"),
        *([("prompts per call", prompts)] if prompts else []),
        ("fullest card", f"{gib(plan.per_card_bytes)} GiB of {gpu_mem_gb:g}"),
        ("why", plan.reason),
    ]
    lines += [f"{name:<18}{value}" for name, value in fields] + [""]
    cards = gpus if plan.mode.startswith("placement") else 1
    held = card_bytes(stats, cards, plan.rows_per_call, prompt_len, completion_len, dtype, plan.weights_dtype == "nf4")
    rows = [
        [
            str(k) if cards > 1 else "each",
            f"{c.layers.start}-{c.layers.stop - 1}" if c.layers else "-",
            *(gib(n) if n else "-" for n in (c.weights, c.kv_cache, c.working, c.logits)),
            gib(c.total),
        ]
        for k, c in enumerate(held)
    ]
    headers = ["card", "layers", "weights", "KV cache", "working", "logits", "GPU GiB"]
    lines += [format_table(headers, rows, [False, False, True, True, True, True, True]), ""]
    lines.append(
        "A card holds its weights and its layers' KV cache of the rows at prompt + completion tokens, and while it"
        " computes, the prefill's largest layer over the rows' prompts (NF4: and one weight dequantised) and, on the"
        f" LM head's card, the last position's logits; GPU adds {gib(CUDA_RESERVE)} GiB of CUDA context and"
        f" {FRAGMENTATION:.0%} fragmentation."
    )
    return "\n".join(lines)
