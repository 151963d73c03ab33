"""The planner's reports: one model's table and recommendation, its longest sequences, and README's fit table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from deepzero.plan.arch import Arch, ModelStats, model_stats
from deepzero.plan.generation import kv_cache_bytes
from deepzero.plan.memory import CUDA_RESERVE, FRAGMENTATION, Estimate, GiB, estimate, gib
from deepzero.plan.search import (
    COMPLETION_STEP,
    MAX_MICRO_BATCH,
    MAX_SEQ_SEARCH,
    SEQ_STEP,
    LongestSeq,
    Recommendation,
    generation_rows,
    longest_completions,
    longest_sequence,
    longest_sequences,
    max_micro_batch,
    recommend,
)
from deepzero.plan.setup import GrpoTerms, SaverTerms, Setup, load_preset, setup_from_ds_config
from deepzero.presets import PRESETS

LORA_RANK = 16


def _seq_cell(best: LongestSeq | None, arch: Arch) -> str:
    if best is None:
        return f"under {SEQ_STEP:,}"
    n = f"≥ {best.seq_len:,}" if best.seq_len >= MAX_SEQ_SEARCH else f"{best.seq_len:,}"
    context = f"; over the {arch.max_positions:,} context" if best.seq_len > arch.max_positions > 0 else ""
    return f"{n} ({best.label()}{context})"


def render_longest(
    stats: ModelStats, world_size: int, gpu_mem_gb: float, cpu_mem_gb: float, lora_rank: int, **kw: Any
) -> str:
    """``--max-seq-len``: the longest sequence of every preset and saver choice, full and LoRA, and the limit."""
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    full = longest_sequences(stats, world_size, gpu_mem, cpu_mem, **kw)
    lora = longest_sequences(stats, world_size, gpu_mem, cpu_mem, lora_rank=lora_rank, **kw)
    lines = [
        f"{stats.name}: longest sequence at micro-batch 1 on {world_size} × {gpu_mem_gb:g} GiB, host {cpu_mem_gb:g} "
        f"GiB (multiples of {SEQ_STEP}; model context {stats.arch.max_positions:,})",
        "",
    ]
    rows = [
        [
            r.preset,
            str(r.setup.sequence_parallel),
            "on" if r.setup.checkpointing else "off",
            "on" if r.setup.savers.offload else "off",
            "on" if r.setup.savers.tiled_mlp else "off",
            f"{r.seq_len:,}",
            f"{q.seq_len:,}",
        ]
        for r, q in zip(full, lora, strict=True)
    ]
    headers = ["preset", "SP", "ckpt", "offload", "tiled MLP", "full", f"LoRA r{lora_rank}"]
    lines += [format_table(headers, rows, [False] * 5 + [True] * 2), ""]
    for what, runs in (("full fine-tuning", full), (f"LoRA r{lora_rank}", lora)):
        best = max(runs, key=lambda r: r.seq_len)
        if not best.seq_len:
            lines.append(f"Longest for {what}: nothing trains {SEQ_STEP} tokens.")
            continue
        over = estimate(stats, replace(best.setup, seq_len=best.seq_len + SEQ_STEP))
        lines.append(
            f"Longest for {what}: {_seq_cell(best, stats.arch)}; at {over.setup.seq_len:,}: {_breakdown(over)}"
        )
    return "\n".join(lines)


def _breakdown(e: Estimate) -> str:
    return (
        f"GPU {gib(e.gpu_total)} GiB (params {gib(e.params)}, grads {gib(e.grads)}, optimizer {gib(e.optimizer)}, "
        f"activations {gib(e.activations)}, logits {gib(e.logits)}, buffers {gib(e.buffers)}, step {gib(e.step)}, "
        f"CUDA+fragmentation {gib(e.other)}), host {gib(e.host)} GiB"
    )


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


def table_setups(
    stats: ModelStats,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    lora_rank: int,
    pretrained: bool = True,
    savers: SaverTerms | None = None,
) -> list[Setup]:
    """Every stage × offload × {full, LoRA, QLoRA} × {checkpointing off, on} combination (QLoRA: LoRA on a 4-bit
    base, without parameter offload)."""
    out = []
    for stage, opt, par, preset in TABLE_ROWS:
        ds = load_preset(preset)
        zero = {**ds.get("zero_optimization", {}), "stage": stage}
        zero["offload_optimizer"] = {"device": "cpu" if opt else "none"}
        zero["offload_param"] = {"device": "cpu" if par else "none"}
        ds = {**ds, "zero_optimization": zero, "bf16": {"enabled": True}}
        trainings = [(0, False), (lora_rank, False)] + [(lora_rank, True)] * (pretrained and not par)
        for lora, four_bit in trainings:
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
                        pretrained=pretrained,
                        savers=SaverTerms.choose(stats.arch) if savers is None else savers,
                        four_bit=four_bit,
                    )
                )
    return out


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
    pretrained = kw.get("pretrained", True)
    savers = kw.get("savers") or SaverTerms.choose(stats.arch)
    pair_rows = kw.get("pair_rows", 1)  # sequences per sample: a preference pair is 2 (recommend whole pairs)
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    a = stats.arch
    moe = f", MoE {a.moe_layers}/{a.layers} layers, {a.experts_per_token} of {a.experts} experts" if a.experts else ""
    mla = f", MLA (kv rank {a.kv_lora_rank})" if a.kv_lora_rank else ""
    lines = [
        f"{stats.name}: {_count(stats.total)} params ({_count(stats.active)} active per token, "
        f"{_count(stats.embedding)} embedding+lm_head), {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}{mla}{moe}",
        f"{world_size} GPUs × {gpu_mem_gb:g} GiB, host RAM {cpu_mem_gb:g} GiB, seq len {seq_len}, micro-batch "
        f"{micro_batch}, LoRA rank {lora_rank} on {len(stats.lora_shapes)} linears "
        f"({_count(sum(stats.lora_numels(lora_rank)))} trainable). Memory savers: {savers.label()} (offload: "
        "checkpointed rows only).",
        "GiB per card (busiest rank); bf16 and fp16 hold the same bytes (16-bit weights/grads/activations, fp32 "
        "master + Adam m, v), so each row is both.",
        "",
    ]
    headers = ["ZeRO", "offload", "train", "ckpt", "params", "grads", "optim", "activ", "logits", "buffers"]
    headers += ["GPU", "host", "fits", "max mb"]
    rows = []
    for setup in table_setups(stats, world_size, seq_len, micro_batch, lora_rank, pretrained, savers):
        e = estimate(stats, setup)
        gpu_ok, host_ok = e.gpu_total <= gpu_mem, e.host <= cpu_mem
        mark = "✓" if gpu_ok and host_ok else "✗ GPU" if not gpu_ok else "✗ host"
        mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem)
        off = "+".join(w for w, on in (("opt", setup.offload_optimizer), ("param", setup.offload_params)) if on)
        rows.append(
            [
                str(setup.stage),
                off or "-",
                f"{'QLoRA' if setup.four_bit else 'LoRA'} r{setup.lora_rank}" if setup.lora_rank else "full",
                "on" if setup.checkpointing else "off",
                *(gib(x) for x in (e.params, e.grads, e.optimizer, e.activations, e.logits, e.buffers)),
                gib(e.gpu_total),
                gib(e.host),
                mark,
                (f"{mb}+" if mb == MAX_MICRO_BATCH else str(mb)) if mb else "-",
            ]
        )
    right = [False] * 4 + [True] * 8 + [False, True]
    lines.append(format_table(headers, rows, right))
    lines += [
        "",
        "optim = fp32 master + Adam m, v. GPU = params + grads + optim + max(activ + logits + buffers, fp32 gradient "
        f"copy made by the step) + {gib(CUDA_RESERVE)} GiB CUDA/NCCL + {FRAGMENTATION:.0%} fragmentation. "
        f"host = whole machine ({'pretrained weights load in the training dtype' if pretrained else 'random init: built in fp32'}). max mb = largest micro-batch that fits.",
    ]
    trainings = [("full fine-tuning", 0, False), (f"LoRA r{lora_rank}", lora_rank, False)]
    trainings += [(f"QLoRA r{lora_rank} (4-bit base)", lora_rank, True)] * pretrained
    for what, rank, four_bit in trainings:
        rec = recommend(
            stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=rank, pretrained=pretrained, savers=savers,
            min_micro=pair_rows, four_bit=four_bit,
        )  # fmt: skip
        lines.append(_recommendation_line(what, rec, gpu_mem_gb, pair_rows))
    if pretrained and stats.four_bit_mask:
        quantised = sum(stats.four_bit_numels())
        lines.append(
            f"QLoRA quantises {_count(quantised)} of the {_count(stats.total)} parameters (every nn.Linear but the"
            " LM head, and fused routed experts; routers stay 16-bit). ZeRO-2 loads the whole 4-bit base on every"
            " card; under ZeRO-3 the ranks load it in host RAM one at a time and each card keeps its partition"
            " (GPU and host count that load where it is the peak)."
        )
    return "\n".join(lines)


def _recommendation_line(what: str, rec: Recommendation | None, gpu_mem_gb: float, pair_rows: int = 1) -> str:
    if rec is None:
        unit = " at one pair per micro-batch" if pair_rows > 1 else ""
        return f"Recommended for {what}: nothing fits{unit}, not even ZeRO-3 with parameter and optimizer offload."
    ckpt = "on" if rec.setup.checkpointing else "off"
    ckpt += " (offloaded to host RAM: --activation-offload)" if rec.setup.savers.offload else ""
    alt = " (or zero2 for fp16)" if rec.preset == "zero2_bf16" else ""
    pairs = rec.micro_batch // pair_rows
    micro = f"{pairs} pair{'s' * (pairs != 1)}" if pair_rows > 1 else str(rec.micro_batch)
    return (
        f"Recommended for {what}: ds_configs/{rec.preset}.json{alt}, activation checkpointing {ckpt}, "
        f"micro-batch {micro} (peak {gib(rec.estimate.gpu_total)} of {gpu_mem_gb:g} GiB per card, "
        f"host {gib(rec.estimate.host)} GiB)."
    )


def _fit_cell(rec: Recommendation | None, full: bool) -> str:
    if rec is None:
        return "does not fit"
    ckpt = " + checkpointing" if rec.setup.checkpointing else ""
    ckpt += " (offloaded)" if rec.setup.savers.offload else ""
    where = f"{gib(rec.estimate.gpu_total)} GiB/card, host {gib(rec.estimate.host)} GiB" if full else ""
    return f"`{rec.preset}`{ckpt}, micro {rec.micro_batch}" + (f" ({where})" if where else "")


def fit_table(world_size: int, gpu_mem_gb: float, cpu_mem_gb: float, seq_len: int, lora_rank: int = LORA_RANK) -> str:
    """README's "which preset fits" table: one row per preset naming a checkpoint, from ``recommend``."""
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    box = f"{world_size}× {gpu_mem_gb:g} GB"
    rows = [
        f"| model | full fine-tune | LoRA r{lora_rank} | QLoRA r{lora_rank} | longest sequence on {box}, full | "
        f"longest sequence on {box}, LoRA r{lora_rank} |",
        "|---|---|---|---|---|---|",
    ]
    for name, preset in PRESETS.items():
        if preset.hub_id is None:
            continue
        stats = model_stats(preset.config(), name)
        full = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem)
        lora = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=lora_rank)
        qlora = recommend(stats, world_size, seq_len, gpu_mem, cpu_mem, lora_rank=lora_rank, four_bit=True)
        longest = [
            _seq_cell(longest_sequence(stats, world_size, gpu_mem, cpu_mem, lora_rank=rank), stats.arch)
            for rank in (0, lora_rank)
        ]
        cells = [_fit_cell(full, True), _fit_cell(lora, False), _fit_cell(qlora, True), *longest]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(rows)


MAX_GENERATION_ROWS = 512
"""The most completion rows per generate call the GRPO table plans (8 prompts × G 64)."""


def render_grpo(
    stats: ModelStats,
    world_size: int,
    gpu_mem_gb: float,
    cpu_mem_gb: float,
    grpo: GrpoTerms,
    lora_rank: int,
    completion: int = 1024,
    micro_batch: int = 1,
) -> str:
    """``--grpo``: the longest completion GRPO generates and trains per preset, full and LoRA, and at that length
    the KV cache of the rows generated together and the card's peak; and per preset the most rows one generate
    call takes beside LoRA training at ``completion`` tokens (the generation batch train.py would use). Training
    holds ``micro_batch`` prompt + completion rows at a time (train.py's ``--micro-batch``: completions)."""
    gpu_mem, cpu_mem = gpu_mem_gb * GiB, cpu_mem_gb * GiB
    mb = micro_batch
    full = longest_completions(stats, world_size, gpu_mem, cpu_mem, grpo, micro_batch=mb)
    lora = longest_completions(stats, world_size, gpu_mem, cpu_mem, grpo, lora_rank, micro_batch=mb)
    qlora = longest_completions(stats, world_size, gpu_mem, cpu_mem, grpo, lora_rank, four_bit=True, micro_batch=mb)
    lines = [
        f"{stats.name}: GRPO's longest completion on {world_size} × {gpu_mem_gb:g} GiB, host {cpu_mem_gb:g} GiB: "
        f"{grpo.batch_rows} completion rows generated together (G {grpo.generations}), prompts of"
        f" {grpo.prompt_len} tokens, micro-batch {micro_batch} (completions; multiples of {COMPLETION_STEP} tokens;"
        f" model context {stats.arch.max_positions:,})",
        "",
    ]

    def cell(r: LongestSeq) -> str:
        if not r.seq_len:  # r.setup and r.estimate are at prompt + r.seq_len: the search's own
            return "-"
        return f"{r.seq_len:,} (KV {gib(kv_cache_bytes(stats, r.setup))}, GPU {gib(r.estimate.gpu_total)})"

    def batch(r: LongestSeq) -> str:
        setup = replace(r.setup, seq_len=grpo.prompt_len + completion, grpo=replace(grpo, rows=1))
        if not estimate(stats, setup).fits(gpu_mem, cpu_mem):  # not even one row
            return "-"
        return f"{generation_rows(stats, setup, gpu_mem, cpu_mem, MAX_GENERATION_ROWS):,}"

    rows = [
        [f.preset, "on" if f.setup.checkpointing else "off", cell(f), cell(q), cell(four), batch(q)]
        for f, q, four in zip(full, lora, qlora, strict=True)
    ]
    headers = [
        "preset",
        "ckpt",
        "full (KV cache, GPU GiB)",
        f"LoRA r{lora_rank} (KV cache, GPU GiB)",
        f"QLoRA r{lora_rank} (KV cache, GPU GiB)",
        f"LoRA rows per call at {completion:,}",
    ]
    lines += [format_table(headers, rows, [False, False, True, True, True, True]), ""]
    lines.append(
        "Each rank holds its states, and while it generates: the KV cache of the rows generated together"
        " (rows × (prompt + completion) tokens, every layer), the prefill's largest layer, and under ZeRO-3 the whole"
        " model gathered for generation (as TRL's ds3_gather_for_generation). A frozen reference copy (beta > 0"
        " without LoRA) would add the weights once more; this table plans beta 0, TRL's default. QLoRA: the base in"
        " 4 bits, its parameter-offload presets refused (-). Rows per call: the most completion rows (at most"
        f" {MAX_GENERATION_ROWS}) one generate call takes beside LoRA training at {completion:,}-token completions;"
        " train.py uses all of a rank's rows, or that many where they do not fit (--generation-batch-size sets it)."
    )
    return "\n".join(lines)
