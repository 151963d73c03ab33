"""train.py vs a bare ``deepspeed.initialize`` loop vs HF Trainer: same model, data, ds_config and global batch.

    python -m bench.compare_loops                          # 3 repetitions × 3 loops, interleaved, 3 ranks each
    python -m bench.compare_loops --reps 5 --steps 30 --deepspeed-config ds_configs/zero2_bf16.json

Every loop is started by the real launcher (``deepspeed --num_gpus=N``) on tiny-deepseek-v3 built with
``from_config`` and seed 0, over the same prepared rows, with the ds_config resolved by deepzero.dsconfig. Each loop
writes train.py-shaped records (step, host time) every ``--log-interval`` steps; a run's figure is the median
seconds per optimizer step over its log windows after the first (warm-up), windows measured record to record so
they include everything the loop does (data, compute, its own logging). A loop's figure is the median over
repetitions; repetitions are interleaved in rotating order (A B C, B C A, C A B, ...) so that drift in the machine's
load hits every loop alike, and on a CPU-only machine each run first waits (up to ``--max-wait`` s) until other
processes use fewer than ``--max-busy`` cores. Prints and writes the ratios train.py / bare and train.py / HF
Trainer (below 1: train.py is faster) to ``bench/results/compare_loops.{json,md}``; the ratio of the best windows is
given too (noise on a shared machine only ever adds time). Targets: train.py within 3 % of the bare loop per step and
no slower than HF Trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

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

# name -> (launch target, launched as a module)
LOOPS: dict[str, tuple[str, bool]] = {
    "train.py": ("train.py", False),
    "bare": ("bench.bare_loop", True),
    "hf_trainer": ("bench.hf_trainer_loop", True),
}
MAX_VS_BARE = 1.03
MAX_VS_HF = 1.00


def loop_args(args: argparse.Namespace, name: str, out: Path) -> list[str]:
    """The same flags for every loop; train.py also turns off eval, checkpoints and export."""
    common = [
        "--deepspeed_config", args.deepspeed_config, "--model", args.model, "--data", args.data, "--out", str(out),
        "--max-steps", str(args.steps), "--log-interval", str(args.log_interval), "--seed", "0",
        "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
    ]  # fmt: skip
    if args.micro_batch:
        common += ["--micro-batch", str(args.micro_batch)]
    if args.grad_accum:
        common += ["--grad-accum", str(args.grad_accum)]
    if name == "train.py":
        common += ["--eval-interval", "0", "--save-interval", "0", "--no-export"]
    return common


def run_once(args: argparse.Namespace, name: str, rep: int) -> dict[str, Any]:
    """One launch of one loop: its per-window step times and their median."""
    target, module = LOOPS[name]
    out = repo_path(args.work) / f"{name.replace('.', '_')}-rep{rep}"
    (out / "metrics.jsonl").unlink(missing_ok=True)
    quiet = wait_for_quiet(args.max_busy, args.max_wait)
    wall = launch(target, loop_args(args, name, out), args.ranks, out / "launcher.log", module=module)
    windows = window_step_times(train_records(out))
    median = statistics.median(windows)
    print(f"  rep {rep} {name:<11} {median * 1e3:8.1f} ms/step  (windows {', '.join(f'{w:.3f}' for w in windows)})")
    return {"rep": rep, "step_time_s": median, "windows_s": windows, "wall_s": wall, "out": str(out), **quiet}


def rotation(names: list[str], rep: int) -> list[str]:
    """Rep r runs the loops rotated by r: A B C, B C A, C A B, ..."""
    k = rep % len(names)
    return names[k:] + names[:k]


def summarize(runs: dict[str, list[dict[str, Any]]], tokens_per_step: int) -> dict[str, Any]:
    """Per-loop medians, the two ratios (of medians, and median of per-rep paired ratios) and pass/fail."""
    loops = {}
    for name, reps in runs.items():
        times = [r["step_time_s"] for r in reps]
        loops[name] = {
            "step_time_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "tokens_per_s": tokens_per_step / statistics.median(times),
            "reps": reps,
        }
    ours = loops["train.py"]["step_time_s"]
    paired = {
        other: statistics.median(
            a["step_time_s"] / b["step_time_s"] for a, b in zip(runs["train.py"], runs[other], strict=True)
        )
        for other in ("bare", "hf_trainer")
    }
    vs_bare, vs_hf = ours / loops["bare"]["step_time_s"], ours / loops["hf_trainer"]["step_time_s"]
    best = {name: min(w for r in reps for w in r["windows_s"]) for name, reps in runs.items()}
    return {
        "loops": loops,
        "ratio_train_vs_bare": vs_bare,
        "ratio_train_vs_hf_trainer": vs_hf,
        "paired_ratio_train_vs_bare": paired["bare"],
        "paired_ratio_train_vs_hf_trainer": paired["hf_trainer"],
        "best_window_s": best,
        "best_window_ratio_train_vs_bare": best["train.py"] / best["bare"],
        "best_window_ratio_train_vs_hf_trainer": best["train.py"] / best["hf_trainer"],
        "pass_vs_bare": vs_bare <= MAX_VS_BARE,
        "pass_vs_hf_trainer": vs_hf <= MAX_VS_HF,
    }


def markdown(result: dict[str, Any]) -> str:
    """Table of per-loop step times and the ratios."""
    s = result["summary"]
    lines = [
        "# train.py vs bare deepspeed loop vs HF Trainer",
        "",
        f"`{result['model']}`, `{result['deepspeed_config']}`, {result['ranks']} ranks, {result['batch']},"
        f" {result['steps']} steps, log every {result['log_interval']} (first window dropped),"
        f" {result['reps']} interleaved repetitions. Machine: {result['machine'].get('gpu') or 'CPU only'},"
        f" {result['machine']['cpu_count']} cores.",
        "",
        "| loop | median s/step | min–max over reps | tokens/s | per-rep medians (s) |",
        "|---|---|---|---|---|",
    ]
    for name, loop in s["loops"].items():
        reps = ", ".join(f"{r['step_time_s']:.3f}" for r in loop["reps"])
        lines.append(
            f"| {name} | {loop['step_time_s']:.3f} | {loop['min_s']:.3f}–{loop['max_s']:.3f}"
            f" | {loop['tokens_per_s']:,.0f} | {reps} |"
        )
    busy = [r.get("busy_cores_before") for loop in s["loops"].values() for r in loop["reps"]]
    if busy and None not in busy:
        lines += ["", f"Cores used by other processes just before each run: {min(busy):.1f}–{max(busy):.1f}."]
    ok = {True: "pass", False: "FAIL"}
    lines += [
        "",
        "| ratio (step time) | of medians | median of paired reps | of best windows | target | result (medians) |",
        "|---|---|---|---|---|---|",
        f"| train.py / bare | {s['ratio_train_vs_bare']:.3f} | {s['paired_ratio_train_vs_bare']:.3f}"
        f" | {s['best_window_ratio_train_vs_bare']:.3f} | ≤ {MAX_VS_BARE:.2f} | {ok[s['pass_vs_bare']]} |",
        f"| train.py / HF Trainer | {s['ratio_train_vs_hf_trainer']:.3f} | {s['paired_ratio_train_vs_hf_trainer']:.3f}"
        f" | {s['best_window_ratio_train_vs_hf_trainer']:.3f} | ≤ {MAX_VS_HF:.2f} | {ok[s['pass_vs_hf_trainer']]} |",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=3)
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--deepspeed-config", default="ds_configs/zero2.json")
    p.add_argument("--data", default="artifacts/data/stdlib")
    p.add_argument("--micro-batch", type=int, default=None, help="Default: the ds_config's.")
    p.add_argument("--grad-accum", type=int, default=None, help="Default: the ds_config's.")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--max-busy", type=float, default=quiet_default(), help="Wait for others to use fewer cores.")
    p.add_argument("--max-wait", type=float, default=600, help="Longest wait for a quiet machine, per run (s).")
    p.add_argument("--loops", nargs="+", default=list(LOOPS), choices=list(LOOPS))
    p.add_argument("--work", default="runs/bench/compare_loops")
    p.add_argument("--results", default="bench/results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every loop ``reps`` times, interleaved; write and print the comparison."""
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
    seq_len = int(load_meta(args.data)["seq_len"])
    print(f"{len(args.loops)} loops × {args.reps} reps on {args.ranks} ranks; {cfg.batch.describe(seq_len)}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.loops}
    for rep in range(args.reps):
        for name in rotation(args.loops, rep):
            runs[name].append(run_once(args, name, rep))
    result: dict[str, Any] = {
        "model": args.model,
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
    }
    if set(args.loops) == set(LOOPS):
        result["summary"] = summarize(runs, cfg.batch.global_batch * seq_len)
        write_results(args.results, "compare_loops", result, markdown(result))
    else:
        result["runs"] = runs  # a partial comparison is printed, never written over the full one
        print(json.dumps({n: [r["step_time_s"] for r in rs] for n, rs in runs.items()}, indent=2))
    return result


if __name__ == "__main__":
    main()
