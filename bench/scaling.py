"""Data-parallel scaling of train.py: 1 rank vs N ranks at the same global batch, through the real launcher.

    python -m bench.scaling                       # 1 vs 3 ranks, micro 4, global 12; CPU here, GPUs where present
    python -m bench.scaling --ranks 3 --micro-batch 4 --grad-accum 1 --steps 24 --log-interval 4 --reps 2

The 1-rank run uses gradient accumulation ``ranks × A`` and the N-rank run ``A``, so one optimizer step covers
the same global batch (``micro × ranks × A`` sequences) in both. Each configuration runs ``--reps`` times in ABBA
order (1 N, N 1, ...) so that a drifting machine load hits both alike; on a CPU-only machine each run first waits for
other processes to use fewer than ``--max-busy`` cores. Each run's ``metrics.jsonl`` is read back, the
first log window is dropped as warm-up, and the medians of the remaining windows, then over repetitions, are
reported: tokens/s, achieved FLOP/s (FLOPs per token from the model itself, see deepzero.flops) and MFU where the
device peak is known, peak memory per rank. Scaling efficiency = tokens/s on N ranks / (N × tokens/s on 1 rank). Writes
``bench/results/scaling.json`` and ``bench/results/scaling.md``.

Also the home of the launcher helpers the other bench scripts share (:func:`launch`, :func:`window_step_times`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepzero.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def repo_path(path: str | Path) -> Path:
    """A path as the launched runs see it: relative paths are relative to the repository root."""
    path = Path(path)
    return path if path.is_absolute() else REPO / path


def write_results(results: str | Path, name: str, result: dict[str, Any], text: str) -> None:
    """Write ``<results>/<name>.json`` and ``<name>.md`` (relative to the repository root) and print the markdown."""
    folder = repo_path(results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / f"{name}.md").write_text(text)
    print(text)


def launch_env() -> dict[str, str]:
    """The environment for a launched run: on a CPU-only machine, DeepSpeed's CPU accelerator and 1 thread a rank."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not torch.cuda.is_available():
        env |= {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_API_KEY", None)
    return env


def busy_cores(interval: float = 2.0) -> float:
    """How many CPU cores other processes keep busy right now (from /proc/stat over ``interval`` seconds)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)


def quiet_default() -> float | None:
    """Default ``--max-busy``: on a CPU-only machine wait until others use under half a core; on GPUs, don't wait."""
    return None if torch.cuda.is_available() else 0.5


def wait_for_quiet(max_busy: float | None, max_wait: float) -> dict[str, Any]:
    """Before a CPU measurement on a shared machine: wait (up to ``max_wait`` s) until others use < ``max_busy`` cores.

    Returns what was found, recorded with the run. ``max_busy`` None (the default on GPU machines) skips the wait.
    """
    if max_busy is None:
        return {}
    start = time.monotonic()
    busy = busy_cores()
    while busy >= max_busy and time.monotonic() - start < max_wait:
        time.sleep(10)
        busy = busy_cores()
    waited = time.monotonic() - start
    if busy >= max_busy:
        print(f"  machine still busy ({busy:.1f} cores used by others) after {waited:.0f} s; measuring anyway")
    return {"busy_cores_before": round(busy, 2), "waited_s": round(waited, 1)}


EXTERNAL_STOP = "Main process received SIG"  # DeepSpeed's launcher was signalled from outside: not the loop's fault


def launch(
    target: str, args: Sequence[str], nproc: int, log: Path, module: bool = False, timeout: int = 1800, retries: int = 2
) -> float:
    """``deepspeed --num_gpus=N [--module] TARGET ARGS`` from the repo root; output to ``log``. Returns wall seconds.

    Raises RuntimeError with the log's tail if the run fails, so a broken loop is never reported as a fast one. A run
    whose launcher was stopped by a signal from outside (a shared machine's cleanup) is started again, ``retries``
    times at most.
    """
    cmd = [str(DEEPSPEED), f"--num_gpus={nproc}", f"--master_port={free_port()}"]
    cmd += ["--module", target] if module else [target]
    cmd += list(args)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        text = log.read_text()
        if EXTERNAL_STOP in text and retries > 0:
            print(f"  {target}: launcher stopped by an outside signal; starting it again")
            return launch(target, args, nproc, log, module, timeout, retries - 1)
        tail = "\n".join(text.splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; log {log}:\n{tail}")
    return wall


def train_records(out: Path) -> list[dict[str, Any]]:
    """The ``kind == "train"`` records of ``<out>/metrics.jsonl``."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def window_step_times(records: list[dict[str, Any]]) -> list[float]:
    """Seconds per optimizer step in each log window after the first (warm-up), from the records' host times.

    Window ``i`` runs from the record at the end of window ``i - 1`` to the record at its own end, so it includes
    everything the loop did in between (data, forward, backward, step, its own logging), for every loop alike.
    """
    if len(records) < 3:
        raise ValueError(f"need at least 3 log records to time 2 windows after warm-up, got {len(records)}")
    return [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(records)]


def steady(records: list[dict[str, Any]], key: str) -> float | None:
    """Median of ``key`` over the log windows after the first (warm-up); None if the runs don't report it."""
    values = [r[key] for r in records[1:] if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def model_flops_per_token(model: str, data: str) -> float:
    """Training FLOPs per token of ``--model`` as train.py builds it (vocab from the data's tokenizer), on meta."""
    from deepzero import modeling
    from deepzero.data import load_meta
    from deepzero.flops import flops_per_token

    meta = load_meta(data)
    source = modeling.resolve_model(model)
    config = modeling.load_config(source)
    if source.random_init:
        config.vocab_size = len(modeling.load_tokenizer(meta.get("tokenizer") or model))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    return flops_per_token(built, int(meta["seq_len"]))


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],  # other jobs on a shared machine show up here
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    else:
        info["gpu"] = None
        info["note"] = "CPU ranks (DeepSpeed CPU accelerator, gloo, OMP_NUM_THREADS=1 per rank)"
    return info


def run_train(args: argparse.Namespace, ranks: int, accum: int, tag: str) -> dict[str, Any]:
    """One train.py run on ``ranks`` ranks; its steady-state numbers."""
    out = repo_path(args.work) / tag
    train_args = [
        "--deepspeed_config", args.deepspeed_config, "--model", args.model, "--data", args.data, "--out", str(out),
        "--max-steps", str(args.steps), "--log-interval", str(args.log_interval), "--micro-batch",
        str(args.micro_batch), "--grad-accum", str(accum), "--eval-interval", "0", "--save-interval", "0",
        "--no-export", "--seed", "0",
    ]  # fmt: skip
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()
    quiet = wait_for_quiet(args.max_busy, args.max_wait)
    wall = launch("train.py", train_args, ranks, out / "launcher.log")
    records = train_records(out)
    mem_key = next((k for k in records[-1] if k.startswith("peak_") and k.endswith("_mem_gb")), None)
    tps = steady(records, "tokens_per_s")
    return {
        "ranks": ranks,
        "micro_batch": args.micro_batch,
        "grad_accum": accum,
        "global_batch": args.micro_batch * accum * ranks,
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / ranks,
        "step_time_s": steady(records, "step_time_s"),
        "mfu": steady(records, "mfu"),
        "peak_mem_gb_per_rank": records[-1][mem_key] if mem_key else None,
        "peak_mem_kind": mem_key.removeprefix("peak_").removesuffix("_mem_gb") if mem_key else None,
        "windows": len(records) - 1,
        "wall_s": wall,
        "out": str(out),
        **quiet,
    }


def combine(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its repetitions: medians of the measured numbers, each repetition kept."""
    out = dict(reps[0])
    for key in ("tokens_per_s", "tokens_per_s_per_device", "step_time_s", "mfu", "peak_mem_gb_per_rank"):
        values = [r[key] for r in reps if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    keep = ("tokens_per_s", "step_time_s", "wall_s", "out", "busy_cores_before", "waited_s")
    out["reps"] = [{k: r[k] for k in keep if k in r} for r in reps]
    for k in keep[2:]:
        out.pop(k, None)
    return out


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown table plus the one derived number."""
    fpt = result["flops_per_token"]
    busy = [rep["busy_cores_before"] for r in result["runs"] for rep in r["reps"] if "busy_cores_before" in rep]
    lines = [
        f"# Scaling: 1 rank vs {result['ranks']} ranks, same global batch",
        "",
        f"Model `{result['model']}`, `{result['deepspeed_config']}`, seq_len {result['seq_len']},"
        f" {fpt:.3g} FLOPs/token; {result['steps']} steps, log every {result['log_interval']},"
        f" first window dropped, medians of the rest; {result['reps']} repetitions in ABBA order, median shown.",
        f"Machine: {result['machine'].get('gpu') or 'CPU only'}, {result['machine']['cpu_count']} CPU cores."
        + (f" Cores used by other processes just before each run: {min(busy):.1f}–{max(busy):.1f}." if busy else ""),
        "",
        "| ranks | micro × accum | global batch | tokens/s | tokens/s/device | step s | achieved TFLOP/s | MFU"
        " | peak mem/rank GB | tokens/s per rep |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (no peak)"
        mem = f"{r['peak_mem_gb_per_rank']:.2f} ({r['peak_mem_kind']})" if r["peak_mem_gb_per_rank"] else "n/a"
        per_rep = ", ".join(f"{rep['tokens_per_s']:,.0f}" for rep in r["reps"])
        lines.append(
            f"| {r['ranks']} | {r['micro_batch']} × {r['grad_accum']} | {r['global_batch']} | {r['tokens_per_s']:,.0f}"
            f" | {r['tokens_per_s_per_device']:,.0f} | {r['step_time_s']:.3f} | {r['achieved_tflops']:.4f} | {mfu}"
            f" | {mem} | {per_rep} |"
        )
    n = result["ranks"]
    lines += [
        "",
        f"**Scaling efficiency** tokens/s({n}) / ({n} × tokens/s(1)): **{result['scaling_efficiency']:.1%}**"
        f" (speedup {result['speedup']:.2f}× on {n} ranks).",
    ]
    if note := result.get("note"):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3, help="Data-parallel size of the scaled run.")
    p.add_argument("--reps", type=int, default=2, help="Runs of each configuration (ABBA order).")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1, help="Accumulation of the N-rank run (1 rank: N × this).")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--model", default="tiny-deepseek-v3")
    p.add_argument("--deepspeed-config", default="ds_configs/zero2.json")
    p.add_argument("--data", default="artifacts/data/stdlib")
    p.add_argument("--max-busy", type=float, default=quiet_default(), help="Wait for others to use fewer cores.")
    p.add_argument("--max-wait", type=float, default=600, help="Longest wait for a quiet machine, per run (s).")
    p.add_argument("--work", default="runs/bench/scaling", help="Run folders (metrics.jsonl, launcher.log).")
    p.add_argument("--results", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run 1 rank and N ranks ``reps`` times each, write scaling.json and scaling.md, print the table."""
    args = parse_args(argv)
    args.data = str(repo_path(args.data))
    fpt = model_flops_per_token(args.model, args.data)
    from deepzero.data import load_meta

    by_ranks: dict[int, list[dict[str, Any]]] = {1: [], args.ranks: []}
    for rep in range(args.reps):  # ABBA: 1 N, N 1, 1 N, ... so that a drifting load hits both alike
        for ranks in [1, args.ranks] if rep % 2 == 0 else [args.ranks, 1]:
            accum = args.grad_accum * (args.ranks if ranks == 1 else 1)
            by_ranks[ranks].append(run_train(args, ranks, accum, f"ranks{ranks}-rep{rep}"))
    runs = [combine(by_ranks[1]), combine(by_ranks[args.ranks])]
    for r in runs:
        r["achieved_tflops"] = fpt * r["tokens_per_s"] / 1e12
    one, many = runs
    result: dict[str, Any] = {
        "model": args.model,
        "deepspeed_config": args.deepspeed_config,
        "data": args.data,
        "seq_len": int(load_meta(args.data)["seq_len"]),
        "flops_per_token": fpt,
        "steps": args.steps,
        "log_interval": args.log_interval,
        "ranks": args.ranks,
        "reps": args.reps,
        "runs": runs,
        "speedup": many["tokens_per_s"] / one["tokens_per_s"],
        "scaling_efficiency": many["tokens_per_s"] / (args.ranks * one["tokens_per_s"]),
        "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and cores < args.ranks:
        result["note"] = (
            f"This machine has {cores} CPU cores for {args.ranks} single-threaded ranks (and shares them with other"
            f" jobs), so the best possible efficiency here is about {cores / args.ranks:.0%}: this number checks"
            " that the N-rank path works and what its communication costs, not the GPU scaling."
        )
    write_results(args.results, "scaling", result, markdown(result))
    return result


if __name__ == "__main__":
    main()
