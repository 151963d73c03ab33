"""train.py vs a bare ``deepspeed.initialize`` loop vs HF Trainer, doing the same work, plus what balancing and the
tiled loss cost train.py on their own.

    python -m bench.compare_loops                          # 3 repetitions of every variant, interleaved, 3 ranks
    python -m bench.compare_loops --reps 5 --steps 30 --deepspeed-config ds_configs/zero2_bf16.json

Every loop is started by the real launcher (``deepspeed --num_gpus=N``) over the same prepared rows, with the
ds_config resolved by deepzero.dsconfig, seed 0, and computes the same loss: Transformers' own cross-entropy on whole
logits, token-weighted over the global batch (each step's target count is all-reduced first: train.py and the bare
loop pass it as ``num_items_in_batch``, HF Trainer gathers it itself, ``average_tokens_across_devices``). Two cases:

- **moe**: tiny-deepseek-v3 with train.py's ``--moe-balance off --tiled-loss off``, as the other two loops train it
  (no routing-bias update, no balance loss). train.py still counts expert loads for its telemetry: loop overhead.
- **dense**: a tiny Llama-architecture model of the same widths (written seeded to ``<work>/tiny-llama`` and loaded
  by all three loops), where train.py has no router hooks at all: nothing but the loop differs.

Two more train.py runs on the moe case give the cost of what the others leave out: balancing on (``auto``: the V3
bias update and sequence-wise loss) and the tiled loss on (train.py's defaults), each against the moe train.py run.

Each loop writes train.py-shaped records (step, host time) every ``--log-interval`` steps; a run's figure is the
median seconds per optimizer step over its log windows after the first (warm-up), windows measured record to record so
they include everything the loop does. A variant's figure is the median over repetitions; within each case the
variants run in rotating order (A B C, B C A, ...) and the cases alternate, so drift in the machine's load hits every
variant alike; each ratio is also given per repetition (paired), with its spread. On a CPU-only machine each run first
waits (up to ``--max-wait`` s) until other processes use fewer than ``--max-busy`` cores, and records what they used.
Writes ``bench/results/compare_loops.{json,md}`` (with ``--variants`` a subset: ``compare_loops_partial.{json,md}``).
Targets: train.py within 3 % of the bare loop per step and no slower than HF Trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine_clock import engine_seconds
from bench.scaling import (
    launch,
    machine,
    quiet_default,
    repo_path,
    train_records,
    wait_for_quiet,
    window_step_times,
    write_results,
)
from deepzero.presets import PRESETS

# loop -> what bench.engine_clock runs (a script from the repo root, or a module)
LOOPS: dict[str, str] = {"train.py": "train.py", "bare": "bench.bare_loop", "hf_trainer": "bench.hf_trainer_loop"}
MAX_VS_BARE = 1.03
MAX_VS_HF = 1.00
UNTILED = ("--tiled-loss", "off")


@dataclass(frozen=True)
class Variant:
    """One configuration that is launched once per repetition."""

    name: str
    loop: str
    """A key of LOOPS."""
    case: str
    """moe or dense: which model it trains."""
    flags: tuple[str, ...] = ()
    """Extra train.py flags."""


VARIANTS = [
    Variant("moe/train.py", "train.py", "moe", ("--moe-balance", "off", *UNTILED)),
    Variant("moe/bare", "bare", "moe"),
    Variant("moe/hf_trainer", "hf_trainer", "moe"),
    Variant("moe/train.py+balance", "train.py", "moe", ("--moe-balance", "auto", *UNTILED)),
    Variant("moe/train.py+tiled", "train.py", "moe", ("--moe-balance", "off", "--tiled-loss", "on")),
    Variant("dense/train.py", "train.py", "dense", UNTILED),
    Variant("dense/bare", "bare", "dense"),
    Variant("dense/hf_trainer", "hf_trainer", "dense"),
]
BY_NAME = {v.name: v for v in VARIANTS}


@dataclass(frozen=True)
class Comparison:
    """A ratio of step times, numerator / denominator (below 1: the numerator is faster)."""

    label: str
    num: str
    den: str
    target: float | None
    """Upper bound on the ratio; None: a cost to report, not a target."""


COMPARISONS = [
    Comparison("moe (balancing off): train.py / bare", "moe/train.py", "moe/bare", MAX_VS_BARE),
    Comparison("moe (balancing off): train.py / HF Trainer", "moe/train.py", "moe/hf_trainer", MAX_VS_HF),
    Comparison("dense: train.py / bare", "dense/train.py", "dense/bare", MAX_VS_BARE),
    Comparison("dense: train.py / HF Trainer", "dense/train.py", "dense/hf_trainer", MAX_VS_HF),
    Comparison(
        "balancing's own cost: train.py on (bias + seq. loss) / off", "moe/train.py+balance", "moe/train.py", None
    ),
    Comparison("tiled loss's own cost: train.py on / off", "moe/train.py+tiled", "moe/train.py", None),
]
DENSE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
DENSE_WIDTHS = {k: PRESETS["tiny-deepseek-v3"].arch[k] for k in (*DENSE_KEYS, "max_position_embeddings")}
"""tiny-deepseek-v3's attention and dense-MLP widths, as a Llama (deepseek-coder's architecture), untied head."""


def write_dense_model(folder: Path, data: str) -> Path:
    """A seeded random tiny Llama with the data's vocabulary, saved as safetensors: every loop loads these weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepzero import modeling
    from deepzero.data import load_meta

    tokenizer = modeling.load_tokenizer(load_meta(data)["tokenizer"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **DENSE_WIDTHS))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def loop_args(args: argparse.Namespace, variant: Variant, model: str, out: Path) -> list[str]:
    """The same flags for every loop; train.py also turns off eval, checkpoints and export, plus its own flags."""
    common = [
        "--deepspeed_config", args.deepspeed_config, "--model", model, "--data", args.data, "--out", str(out),
        "--max-steps", str(args.steps), "--log-interval", str(args.log_interval), "--seed", "0",
        "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
    ]  # fmt: skip
    if args.micro_batch:
        common += ["--micro-batch", str(args.micro_batch)]
    if args.grad_accum:
        common += ["--grad-accum", str(args.grad_accum)]
    if variant.loop == "train.py":
        common += ["--eval-interval", "0", "--save-interval", "0", "--no-export", *variant.flags]
    return common


def run_dir(args: argparse.Namespace, variant: Variant, rep: int) -> Path:
    """Where one launch of one variant writes (kept: ``--from-runs`` reads them again)."""
    return repo_path(args.work) / f"{variant.name.replace('/', '-').replace('.', '_')}-rep{rep}"


def run_once(args: argparse.Namespace, variant: Variant, model: str, rep: int) -> dict[str, Any]:
    """One launch of one variant: its per-window step times and their median."""
    out = run_dir(args, variant, rep)
    for old in [out / "metrics.jsonl", *out.glob("engine_clock.rank*.json")]:
        old.unlink(missing_ok=True)
    quiet = wait_for_quiet(args.max_busy, args.max_wait)
    loop = [LOOPS[variant.loop], *loop_args(args, variant, model, out)]
    wall = launch("bench.engine_clock", loop, args.ranks, out / "launcher.log", module=True)
    (out / "launch.json").write_text(json.dumps({"wall_s": wall, **quiet}) + "\n")
    return read_run(out, rep, variant, args.ranks)


def read_run(out: Path, rep: int, variant: Variant, ranks: int) -> dict[str, Any]:
    """A finished launch's per-window step times, their median, the split of its timed steps between the engine
    and the loop's own time (bench.engine_clock), and what was recorded about the launch."""
    records = train_records(out)
    windows = window_step_times(records)
    median = statistics.median(windows)
    split = engine_split(out, records, ranks)
    shown = ", ".join(f"{w:.3f}" for w in windows)
    own = f"; loop's own {split['loop_s'] * 1e3:.1f} ms/step" if split else ""
    print(f"  rep {rep} {variant.name:<21} {median * 1e3:8.1f} ms/step{own}  (windows {shown})")
    launch_info = json.loads((out / "launch.json").read_text()) if (out / "launch.json").is_file() else {}
    return {"rep": rep, "step_time_s": median, "windows_s": windows, "out": str(out), **split, **launch_info}


def engine_split(out: Path, records: list[dict[str, Any]], ranks: int) -> dict[str, float]:
    """Over the timed windows (after the first): mean seconds per step, the part spent inside DeepSpeed's forward,
    backward and step (mean over ranks), and the rest, the loop's own time. Empty without a clock, and on CUDA,
    where the engine's calls return once their kernels are queued (the device time lands at the loop's syncs)."""
    import torch

    start, end = records[0], records[-1]
    steps = end["step"] - start["step"]
    inside = engine_seconds(out, start["time"], end["time"], ranks)
    if inside is None or torch.cuda.is_available():
        return {}
    mean = (end["time"] - start["time"]) / steps
    return {"mean_step_s": mean, "engine_s": inside / steps, "loop_s": mean - inside / steps}


def finished(args: argparse.Namespace, variant: Variant, rep: int) -> bool:
    """Whether this launch is already in ``--work`` with all its ``--steps`` (metrics.jsonl up to the last step)."""
    out = run_dir(args, variant, rep)
    records = train_records(out) if (out / "metrics.jsonl").is_file() else []
    return bool(records) and records[-1]["step"] == args.steps


def measure(args: argparse.Namespace, models: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Every variant ``--reps`` times in ``schedule`` order; ``--resume`` reads finished launches instead of
    starting them again, ``--from-runs`` starts none."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    for rep in range(args.reps):
        for name in schedule(args.variants, rep):
            v = BY_NAME[name]
            if (args.resume or args.from_runs) and finished(args, v, rep):
                runs[name].append(read_run(run_dir(args, v, rep), rep, v, args.ranks))
            elif not args.from_runs:
                runs[name].append(run_once(args, v, models[v.case], rep))
    return runs


def rotation(names: list[str], rep: int) -> list[str]:
    """Rep r runs the names rotated by r: A B C, B C A, C A B, ..."""
    k = rep % len(names) if names else 0
    return names[k:] + names[:k]


def schedule(names: list[str], rep: int) -> list[str]:
    """Rep r's launch order: each case's variants rotated by r, the cases in alternating order (dense first at rep 0)."""
    cases = list(dict.fromkeys(BY_NAME[n].case for n in names))
    cases = cases[::-1] if rep % 2 == 0 else cases
    return [n for case in cases for n in rotation([n for n in names if BY_NAME[n].case == case], rep)]


def compare(runs: dict[str, list[dict[str, Any]]], c: Comparison) -> dict[str, Any]:
    """One ratio three ways (of medians, per-repetition pairs, best windows) and where it stands to its target."""
    med = {n: statistics.median(r["step_time_s"] for r in runs[n]) for n in (c.num, c.den)}
    den = {r["rep"]: r["step_time_s"] for r in runs[c.den]}
    paired = [r["step_time_s"] / den[r["rep"]] for r in runs[c.num] if r["rep"] in den]  # same repetition only
    best = {n: min(w for r in runs[n] for w in r["windows_s"]) for n in (c.num, c.den)}
    out: dict[str, Any] = {
        "label": c.label,
        "num": c.num,
        "den": c.den,
        "ratio_of_medians": med[c.num] / med[c.den],
        "paired": paired,
        "paired_median": statistics.median(paired),
        "best_window_ratio": best[c.num] / best[c.den],
        "target": c.target,
    }
    own = {r["rep"]: r["loop_s"] for r in runs[c.den] if "loop_s" in r}
    diffs = [r["loop_s"] - own[r["rep"]] for r in runs[c.num] if "loop_s" in r and r["rep"] in own]
    if diffs and BY_NAME[c.num].loop != BY_NAME[c.den].loop:  # two loops over the same engine work: their own
        # times, numerator minus denominator, per repetition (one loop with a feature on and off: the feature runs
        # inside the engine's calls, so the clock cannot price it)
        out["loop_diff_ms"] = [d * 1e3 for d in diffs]
        out["loop_diff_median_ms"] = statistics.median(diffs) * 1e3
    if c.target is not None:
        out["pass"] = out["ratio_of_medians"] <= c.target
        out["every_rep"] = (
            "pass" if max(paired) <= c.target else "fail" if min(paired) > c.target else "straddles the target"
        )
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], tokens_per_step: int) -> dict[str, Any]:
    """Per-variant medians and spread, and every comparison whose two variants ran."""
    variants = {}
    for name, reps in runs.items():
        if not reps:
            continue
        times = [r["step_time_s"] for r in reps]
        v = BY_NAME[name]
        split = {k: statistics.median(r[k] for r in reps) for k in ("engine_s", "loop_s") if all(k in r for r in reps)}
        variants[name] = {
            **split,
            "loop": v.loop,
            "case": v.case,
            "flags": list(v.flags),
            "step_time_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "tokens_per_s": tokens_per_step / statistics.median(times),
            "reps": reps,
        }
    comparisons = [compare(runs, c) for c in COMPARISONS if runs.get(c.num) and runs.get(c.den)]
    return {"variants": variants, "comparisons": comparisons}


def reps_text(summary: dict[str, Any]) -> str:
    """How many repetitions each variant has: "3", or "1–2" when a stopped benchmark left some out."""
    counts = sorted({len(v["reps"]) for v in summary["variants"].values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]} (see each variant)"


def markdown(result: dict[str, Any]) -> str:
    """Table of per-variant step times and the ratios."""
    s = result["summary"]
    lines = [
        "# train.py vs bare deepspeed loop vs HF Trainer, equal work",
        "",
        f"moe: `{result['model']}`; dense: `{result['dense_model']}`. `{result['deepspeed_config']}`,"
        f" {result['ranks']} ranks, {result['batch']}, {result['steps']} steps, log every {result['log_interval']}"
        f" (first window dropped), {reps_text(s)} interleaved repetitions. Every loop: untiled loss, token-weighted"
        f" over the global batch. Machine: {result['machine'].get('gpu') or 'CPU only'},"
        f" {result['machine']['cpu_count']} cores.",
        "",
        "| variant | train.py flags | median s/step | min–max over reps | tokens/s | per-rep medians (s)"
        " | in the engine (s/step) | loop's own (ms/step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in s["variants"].items():
        reps = ", ".join(f"{r['step_time_s']:.3f}" for r in v["reps"])
        flags = f"`{' '.join(v['flags'])}`" if v["flags"] else ""
        engine = f"{v['engine_s']:.3f}" if "engine_s" in v else "—"
        own = f"{v['loop_s'] * 1e3:.1f}" if "loop_s" in v else "—"
        lines.append(
            f"| {name} | {flags} | {v['step_time_s']:.3f} | {v['min_s']:.3f}–{v['max_s']:.3f}"
            f" | {v['tokens_per_s']:,.0f} | {reps} | {engine} | {own} |"
        )
    busy = [r.get("busy_cores_before") for v in s["variants"].values() for r in v["reps"]]
    if busy and None not in busy:
        lines += ["", f"Cores used by other processes just before each run: {min(busy):.1f}–{max(busy):.1f}."]
    lines += [
        "",
        "| ratio (step time) | of medians | paired reps: median (min–max) | of best windows | target | result"
        " | loop's own time: difference, paired (ms/step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in s["comparisons"]:
        target, verdict = "cost", "—"
        if c["target"] is not None:
            target = f"≤ {c['target']:.2f}"
            verdict = f"{'pass' if c['pass'] else 'FAIL'} (medians); every rep: {c['every_rep']}"
        spread = f"{min(c['paired']):.3f}–{max(c['paired']):.3f}"
        own = "—"
        if "loop_diff_ms" in c:
            own = f"{c['loop_diff_median_ms']:+.1f} ({min(c['loop_diff_ms']):+.1f} to {max(c['loop_diff_ms']):+.1f})"
        lines.append(
            f"| {c['label']} | {c['ratio_of_medians']:.3f} | {c['paired_median']:.3f} ({spread})"
            f" | {c['best_window_ratio']:.3f} | {target} | {verdict} | {own} |"
        )
    lines += ["", LOOP_TIME_NOTE]
    return "\n".join(lines) + "\n"


LOOP_TIME_NOTE = (
    "In the engine: the host time every rank spent inside DeepSpeed's forward, backward and step over the timed"
    " windows, per step, mean over ranks (bench/engine_clock.py); the loop's own time is the rest of the mean step:"
    " drawing data, counting targets, bookkeeping, logging, and the waits at the loop's own collectives. The engine's"
    " calls are the same in every loop of a case (the same rows in the same order: HF Trainer is given train.py's"
    " sampler), so the loops' own times compare the loops themselves. What runs inside those calls counts as the"
    " engine's (router hooks, a balance loss, the tiled loss): the clock does not price balancing or the tiled loss."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=3)
    p.add_argument("--model", default="tiny-deepseek-v3", help="The moe case's model.")
    p.add_argument("--dense-model", default=None, help="The dense case's model. Default: a tiny Llama, written here.")
    p.add_argument("--deepspeed-config", default="ds_configs/zero2.json")
    p.add_argument("--data", default="artifacts/data/stdlib")
    p.add_argument("--micro-batch", type=int, default=None, help="Default: the ds_config's.")
    p.add_argument("--grad-accum", type=int, default=None, help="Default: the ds_config's.")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--max-busy", type=float, default=quiet_default(), help="Wait for others to use fewer cores.")
    p.add_argument("--max-wait", type=float, default=600, help="Longest wait for a quiet machine, per run (s).")
    p.add_argument("--variants", nargs="+", default=list(BY_NAME), choices=list(BY_NAME))
    p.add_argument("--work", default="runs/bench/compare_loops")
    p.add_argument(
        "--from-runs",
        action="store_true",
        help="Launch nothing: summarize the finished runs already in --work (same --reps/--steps), e.g. after a stop.",
    )
    p.add_argument("--resume", action="store_true", help="Keep the finished runs in --work; launch only the others.")
    p.add_argument("--results", default="bench/results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every variant ``reps`` times, interleaved; write and print the comparison."""
    from bench.bare_loop import LoopArgs, resolve_config
    from deepzero.data import load_meta

    args = parse_args(argv)
    args.data = str(repo_path(args.data))
    cfg = resolve_config(
        LoopArgs(
            deepspeed_config=str(repo_path(args.deepspeed_config)),
            model=args.model,
            max_steps=args.steps,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            micro_batch=args.micro_batch,
            grad_accum=args.grad_accum,
        ),
        args.ranks,
    )
    dense = args.dense_model or str(repo_path(args.work) / "tiny-llama")
    if args.dense_model is None and not (args.from_runs or args.resume):
        write_dense_model(Path(dense), args.data)
    models = {"moe": args.model, "dense": dense}
    seq_len = int(load_meta(args.data)["seq_len"])
    print(f"{len(args.variants)} variants × {args.reps} reps on {args.ranks} ranks; {cfg.batch.describe(seq_len)}")
    runs = measure(args, models)
    result: dict[str, Any] = {
        "model": args.model,
        "dense_model": "tiny Llama " + json.dumps(DENSE_WIDTHS) if args.dense_model is None else args.dense_model,
        "deepspeed_config": args.deepspeed_config,
        "ranks": args.ranks,
        "batch": cfg.batch.describe(seq_len),
        "global_batch": cfg.batch.global_batch,
        "seq_len": seq_len,
        "steps": args.steps,
        "log_interval": args.log_interval,
        "reps": args.reps,
        "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "summary": summarize(runs, cfg.batch.global_batch * seq_len),
    }
    if set(args.variants) == set(BY_NAME) and all(runs.values()):
        write_results(args.results, "compare_loops", result, markdown(result))
    else:  # a partial comparison is never written over the full one: compare_loops_partial.{json,md}
        write_results(args.results, "compare_loops_partial", result | {"variants": args.variants}, markdown(result))
    return result


if __name__ == "__main__":
    main()
