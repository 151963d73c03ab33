"""Searches over the estimate: the largest micro-batch that fits, the recommended preset, the longest sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from deepzero.plan.arch import ModelStats
from deepzero.plan.memory import Estimate, estimate
from deepzero.plan.setup import GrpoTerms, SaverTerms, Setup, load_preset, offloads, setup_from_ds_config

PRESET_ORDER = ("zero2_bf16", "zero2", "zero3", "zero2_offload", "zero3_offload")
"""ds_configs presets, fastest first: the recommendation is the first one that fits."""
MAX_MICRO_BATCH = 64
SEQ_STEP = 1024
"""Granularity of the longest-sequence search (tokens)."""
MAX_SEQ_SEARCH = 2**20
"""Longest sequence the search tries (tokens)."""


# ------------------------------------------------------------------------------ micro-batch and preset


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
    four_bit: bool = False,
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
        four_bit=four_bit,
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
    four_bit: bool = False,
) -> Recommendation | None:
    """First preset (fastest first) that fits at micro-batch ``min_micro`` (a preference pair: 2 sequences),
    preferring no activation checkpointing; ``savers`` None = train.py's defaults (the tiled loss). Where no preset
    fits with ``savers``, the checkpointed activations offloaded to host RAM (``--activation-offload``) are the last
    resort; ``four_bit``: LoRA on a 4-bit base (QLoRA), which no parameter-offload preset takes."""
    savers = SaverTerms.choose(stats.arch) if savers is None else savers
    tries = [(savers, (False, True))]
    if not savers.offload:
        tries.append((replace(savers, offload=True), (True,)))
    for terms, checkpointing in tries:
        for name in presets:
            ds = load_preset(name)
            if four_bit and offloads(ds.get("zero_optimization", {}), "offload_param"):  # refused, as quant.choose
                continue
            for ckpt in checkpointing:
                setup = _micro1_setup(ds, stats, world_size, seq_len, ckpt, lora_rank, pretrained, terms, four_bit)
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
    stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, step: int = SEQ_STEP, offset: int = 0
) -> int:
    """Longest multiple of ``step`` (up to ``MAX_SEQ_SEARCH``) at which ``setup`` fits with ``seq_len`` = ``offset``
    + that many tokens (GRPO: the prompt, before the completion searched); 0 if ``step`` does not (memory grows with
    the sequence: bisect)."""
    lo, hi = 0, MAX_SEQ_SEARCH // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(stats, replace(setup, seq_len=offset + mid * step)).fits(gpu_mem, cpu_mem):
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


# ------------------------------------------------------------------------------- GRPO's longest completion


COMPLETION_STEP = 256
"""Granularity of the longest-completion search (tokens)."""


def longest_completion(
    stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, step: int = COMPLETION_STEP
) -> int:
    """Longest completion, a multiple of ``step``, at which GRPO's ``setup`` (its ``grpo`` terms set) generates and
    trains within the cards; 0 if ``step`` tokens do not fit."""
    assert setup.grpo is not None
    return longest_seq_len(stats, setup, gpu_mem, cpu_mem, step, offset=setup.grpo.prompt_len)


def longest_completions(
    stats: ModelStats,
    world_size: int,
    gpu_mem: float,
    cpu_mem: float | None,
    grpo: GrpoTerms,
    lora_rank: int = 0,
    four_bit: bool = False,
    micro_batch: int = 1,
) -> list[LongestSeq]:
    """GRPO's longest completion per preset × activation checkpointing at ``micro_batch`` prompt + completion rows
    per training micro-batch (train.py's ``--micro-batch`` under GRPO: completions, as TRL's batch; ``seq_len`` of
    each result is the completion; its setup and estimate are at prompt + that completion, or + one step where none
    fits). ``four_bit``: LoRA on a 4-bit base, whose parameter-offload presets are refused (``seq_len`` 0 there)."""
    out = []
    savers = SaverTerms.choose(stats.arch)
    for name in PRESET_ORDER:
        ds = load_preset(name)
        refused = four_bit and offloads(ds.get("zero_optimization", {}), "offload_param")
        for ckpt in (False, True):
            first = grpo.prompt_len + COMPLETION_STEP
            base = _micro1_setup(ds, stats, world_size, first, ckpt, lora_rank, True, savers, four_bit and not refused)
            setup = replace(base, micro_batch=micro_batch, grpo=grpo)
            n = 0 if refused else longest_completion(stats, setup, gpu_mem, cpu_mem)
            setup = replace(setup, seq_len=grpo.prompt_len + max(n, COMPLETION_STEP))
            out.append(LongestSeq(n, name, setup, estimate(stats, setup)))
    return out


def generation_rows(stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, most: int) -> int:
    """The most completion rows, at most ``most`` (a rank's rows per generation), that GRPO's ``setup`` can
    generate in one ``generate`` call and still fit the cards (1 where even one row does not: the run's own fit
    check says so). What generation holds grows with the rows, so the answer is a bisection."""
    assert setup.grpo is not None

    def fits(rows: int) -> bool:
        return estimate(stats, replace(setup, grpo=replace(setup.grpo, rows=rows))).fits(gpu_mem, cpu_mem)

    low, high = 1, most
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
