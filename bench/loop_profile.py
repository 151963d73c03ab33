"""Where train.py's training loop spends its time, by sampling its stacks with py-spy (``pip install py-spy``).

    python -m bench.loop_profile                   # tiny-deepseek-v3, zero2.json, 1 rank, 30 steps
    python -m bench.loop_profile --steps 60 --rate 100 -- --moe-balance off   # flags after -- go to train.py

One train.py process (a world of one rank, no launcher, so one process holds the whole loop) runs under
``py-spy record``; every sample taken inside ``train_loop`` is put in one bucket by the frames on its stack, first
match wins: MoE balancing hooks (``deepzero/moe_balance.py``), backward (``DeepSpeedEngine.backward``), optimizer
step (``DeepSpeedEngine.step``), forward and loss (``lm_loss``), data (``draw``, the next micro-batches), and the
rest: the loop's own work (logging, tqdm, host syncs at log points, the preemption check, the target-count
all-reduce). Shares of samples do not depend on how fast the machine is at the moment, so this answers "what does the
loop add to forward + backward + step" on a noisy CPU box where step-time ratios between launches cannot
(docs/performance.md). Writes ``bench/results/loop_profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.scaling import RESULTS, launch_env, machine, repo_path, write_results
from deepzero.distributed import free_port

BUCKETS: tuple[tuple[str, str], ...] = (
    ("MoE balancing hooks", "deepzero/moe_balance.py"),
    ("backward", "DeepSpeedEngine.backward"),
    ("optimizer step", "DeepSpeedEngine.step"),
    ("forward + loss", "lm_loss"),
    ("data (next micro-batches)", "draw ("),
)
REST = "loop's own work (logging, syncs, checks)"


def bucket(stack: str) -> str:
    """The bucket of one sampled stack (frames joined by ';', outermost first)."""
    return next((name for name, frame in BUCKETS if frame in stack), REST)


def shares(raw: Path) -> tuple[int, dict[str, int]]:
    """Samples inside train_loop and their count per bucket, from py-spy's raw (collapsed stacks) output."""
    counts: collections.Counter[str] = collections.Counter({name: 0 for name, _ in BUCKETS} | {REST: 0})
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "train_loop (" in stack:
            counts[bucket(stack)] += int(n)
    return sum(counts.values()), dict(counts)


def train_command(args: argparse.Namespace, out: Path) -> list[str]:
    """train.py with eval, checkpoints and export off, as bench.compare_loops runs it."""
    return [
        sys.executable, "train.py", "--deepspeed_config", args.deepspeed_config, "--model", args.model,
        "--data", args.data, "--out", str(out), "--max-steps", str(args.steps), "--log-interval",
        str(args.log_interval), "--seed", "0", "--lr", "2e-3", "--warmup-steps", "30", "--micro-batch",
        str(args.micro_batch), "--eval-interval", "0", "--save-interval", "0", "--no-export", *args.train_args,
    ]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    total = result["samples_in_loop"]
    rows = "\n".join(f"| {name} | {n} | {100 * n / total:.1f} % |" for name, n in result["buckets"].items())
    return (
        "# Where train.py's loop spends its time (py-spy samples)\n\n"
        f"`{result['command']}`\n\n{result['samples_in_loop']} samples inside `train_loop` at {result['rate']} Hz. "
        f"Machine: {result['machine']['cpu_count']} cores, {result['machine']['platform']}, torch {result['machine']['torch']}.\n\n| bucket | samples | share |\n|---|---|---|\n{rows}\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--deepspeed-config", default="ds_configs/zero2.json")
    p.add_argument("--data", default="artifacts/data/stdlib")
    p.add_argument("--micro-batch", type=int, default=12, help="12 × accumulation 2 = the seed preset's batch of 24.")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=3)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second.")
    p.add_argument("--work", default="runs/bench/loop_profile")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("train_args", nargs="*", help="Extra train.py flags, after --.")
    args = p.parse_args(argv)
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        sys.exit("error: py-spy is not installed. Fix: pip install py-spy")
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    work = repo_path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = work / "stacks.raw"
    command = train_command(args, work / "run")
    env = launch_env() | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with (work / "train.log").open("w") as log:
        subprocess.run(
            [py_spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--", *command],
            cwd=repo_path("."), env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
        )  # fmt: skip
    total, counts = shares(raw)
    if total == 0:
        sys.exit(f"error: {raw}: no sample inside train_loop (see {work / 'train.log'})")
    result = {
        "command": " ".join(["python", *command[1:]]).replace(str(work / "run"), "OUT"),
        "rate": args.rate,
        "samples_in_loop": total,
        "buckets": counts,
        "machine": machine(),
    }
    write_results(args.results, "loop_profile", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
