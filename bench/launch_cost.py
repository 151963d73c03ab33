"""What starting the ranks costs the test suite: the same short train.py run, three ways of starting its ranks.

    python -m bench.launch_cost                     # 3 rotated repetitions, 3 ranks, 2 steps of tiny-deepseek-v3

Each repetition times, wall clock from start to exit: ``deepspeed --num_gpus=N train.py ARGS`` (the real launcher);
``python tests/helpers/spawn_ranks.py N PORT train.py ARGS`` (ranks forked from one process that imported torch,
Transformers and DeepSpeed once); and a request to a zygote started before the clock (tests/helpers/zygote.py, what
tests/conftest.launch uses for the session: ranks forked from a process that imported once for all launches). The
order rotates per repetition; every run must log the same losses. Writes ``bench/results/launch_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.scaling import REPO, launch_env, machine, repo_path, write_results
from deepzero.distributed import free_port
from tests.helpers import zygote

WAYS = ("deepspeed launcher", "forked ranks", "zygote")


def command(way: str, ranks: int) -> list[str]:
    if way == "deepspeed launcher":
        return [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={ranks}", f"--master_port={free_port()}"]
    return [sys.executable, "tests/helpers/spawn_ranks.py", str(ranks), str(free_port())]


def ask_zygote(sock: Path, ranks: int, args: list[str], out: Path) -> None:
    """One launch through the zygote, its output beside ``out``."""
    request = {"nproc": ranks, "port": free_port(), "script": "train.py", "args": args, "env": launch_env()}
    _, code = zygote.ask(sock, request | {"stdout": f"{out}.stdout", "stderr": f"{out}.stderr"})
    if code != 0:
        raise RuntimeError(f"zygote launch exited {code}: {Path(f'{out}.stderr').read_text()[-3000:]}")


def timed_run(way: str, ranks: int, args: list[str], out: Path, sock: Path) -> tuple[float, list[float]]:
    """Seconds from start to exit, and the run's logged losses."""
    start = time.monotonic()
    if way == "zygote":
        ask_zygote(sock, ranks, [*args, "--out", str(out)], out)
    else:
        cmd = [*command(way, ranks), "train.py", *args, "--out", str(out)]
        subprocess.run(cmd, cwd=REPO, env=launch_env(), check=True, capture_output=True)
    seconds = time.monotonic() - start
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return seconds, [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def markdown(result: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {way} | {result['median_s'][way]:.1f} | {', '.join(f'{s:.1f}' for s in result['seconds'][way])} |"
        for way in WAYS
    )
    return (
        "# Starting the ranks: the deepspeed launcher, forked ranks (spawn_ranks.py), a zygote (zygote.py)\n\n"
        f"`python -m bench.launch_cost --reps {result['reps']}`: train.py {' '.join(result['train_args'])}, "
        f"{result['ranks']} ranks, start to exit. Same losses every way: {result['same_losses']}. "
        f"Machine: {result['machine']['cpu_count']} cores, torch {result['machine']['torch']}.\n\n"
        f"| way | median s | per repetition (s) |\n|---|---|---|\n{rows}\n\n"
        f"Forked / launcher: {result['ratio']['forked ranks']:.2f}; zygote / launcher: {result['ratio']['zygote']:.2f}.\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--data", default="artifacts/data/stdlib")
    p.add_argument("--results", default="bench/results")
    args = p.parse_args(argv)
    train_args = ["--deepspeed_config", "ds_configs/zero2.json", "--model", "tiny-deepseek-v3"]
    train_args += ["--data", str(repo_path(args.data)), "--max-steps", "2", "--log-interval", "1"]
    train_args += ["--eval-interval", "0", "--save-interval", "0", "--no-export"]
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    losses: dict[str, list[list[float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        server = zygote.start(Path(tmp) / "zygote.sock", launch_env())
        try:
            for rep in range(args.reps):
                for way in WAYS[rep % 3 :] + WAYS[: rep % 3]:
                    out = Path(tmp) / f"{rep}-{way.split()[0]}"
                    took, curve = timed_run(way, args.ranks, train_args, out, Path(tmp) / "zygote.sock")
                    seconds[way].append(took)
                    losses[way].append(curve)
        finally:
            server.kill()
    median = {way: statistics.median(seconds[way]) for way in WAYS}
    result = {
        "reps": args.reps,
        "ranks": args.ranks,
        "train_args": train_args,
        "seconds": seconds,
        "median_s": median,
        "ratio": {way: median[way] / median["deepspeed launcher"] for way in WAYS[1:]},
        "same_losses": all(curve == losses[WAYS[0]][0] for curves in losses.values() for curve in curves),
        "machine": machine(),
    }
    write_results(args.results, "launch_cost", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
