"""Checkpoint I/O: disk write speed, the cost of the durable (fsynced) publish, and the SIGTERM deadline per preset.

    python -m bench.checkpoint_io                          # under runs/bench_ckpt (the disk runs are written to)
    python -m bench.checkpoint_io --dir /scratch/ckpt --sizes-mb 23 256 1024 --reps 3 --sigterm-tiny-s 2.1

1. Write speed: ``checkpoint_storage.measure_write_speed`` (256 MiB, fsynced) in ``--dir``.
2. fsync cost: ``checkpoint.save`` through a stand-in engine that writes ``--ranks`` files of ``size / ranks``
   bytes each (DeepSpeed's ``torch.save`` of one tensor per rank), once as it is (fsync of every file and folder
   before ``latest`` changes) and once with the fsyncs patched out; medians over ``--reps``, ABAB order.
3. Prediction: for every named preset, the checkpoint bytes (``checkpoint_storage.checkpoint_bytes`` from
   ``plan.model_stats``: 16-bit weights + 12 B of fp32 master and Adam moments per parameter) and the time from
   SIGTERM to a committed checkpoint on one node at the measured speed (``preemption.predicted_stop_seconds``,
   steps of ``--step-s``), against the launcher's 30 s grace.
``--sigterm-tiny-s``: the measured tiny-model time (tests/test_reliability.py prints it) is stored with the results.
Writes ``bench/results/checkpoint_io.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch

from deepzero import checkpoint, checkpoint_storage, preemption

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"


class BytesEngine:
    """Writes what a ZeRO checkpoint of ``size`` bytes over ``ranks`` ranks writes: one file per rank."""

    def __init__(self, size: int, ranks: int) -> None:
        self.tensor = torch.ones(max(1, size // ranks // 4), dtype=torch.float32)
        self.ranks = ranks

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        for r in range(self.ranks):
            torch.save({"state": self.tensor, **client_state}, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def save_seconds(folder: Path, size: int, ranks: int, durable: bool, step: int) -> float:
    engine = BytesEngine(size, ranks)
    start = time.perf_counter()
    if durable:
        checkpoint.save(engine, folder, checkpoint.TrainState(step=step), keep_last=1)
    else:
        with (
            mock.patch.object(checkpoint, "_fsync_files", lambda *a: None),
            mock.patch.object(checkpoint, "fsync_dir", lambda *a: None),
        ):
            checkpoint.save(engine, folder, checkpoint.TrainState(step=step), keep_last=1)
    return time.perf_counter() - start


def fsync_costs(folder: Path, sizes_mb: Sequence[int], ranks: int, reps: int) -> list[dict]:
    rows, step = [], 0
    for mb in sizes_mb:
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps):
            for durable in (True, False) if rep % 2 == 0 else (False, True):
                step += 1
                times[durable].append(save_seconds(folder, mb << 20, ranks, durable, step))
        plain, durable = statistics.median(times[False]), statistics.median(times[True])
        rows.append(
            {
                "size_mb": mb,
                "ranks": ranks,
                "save_s": round(plain, 3),
                "save_fsync_s": round(durable, 3),
                "fsync_cost_s": round(durable - plain, 3),
                "fsync_cost_pct": round(100 * (durable - plain) / plain, 1),
            }
        )
        print(f"{mb:>6} MB: save {plain:.3f} s, with fsync {durable:.3f} s (+{durable - plain:.3f} s)")
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def predictions(speed: float, step_s: float) -> list[dict]:
    from deepzero.plan import model_stats
    from deepzero.presets import PRESETS

    rows = []
    for name, preset in sorted(PRESETS.items()):
        params = model_stats(preset.config(), name).total
        size = checkpoint_storage.checkpoint_bytes(params, params, 2)
        need = preemption.predicted_stop_seconds(size, speed, step_s)
        rows.append(
            {
                "preset": name,
                "params": params,
                "checkpoint_gb": round(size / 1e9, 3),
                "predicted_sigterm_to_commit_s": round(need, 1),
                "exceeds_launcher_grace": need > preemption.LAUNCHER_GRACE_S,
            }
        )
        print(f"{name:<28} {params / 1e9:7.2f} B params {size / 1e9:8.1f} GB  SIGTERM → commit {need:8.1f} s")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_io", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/bench_ckpt"))
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[23, 256, 1024])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=1.0, help="optimizer step time for the prediction")
    parser.add_argument("--sigterm-tiny-s", type=float, help="measured SIGTERM → commit of the tiny model")
    args = parser.parse_args(argv)
    speed = statistics.median(checkpoint_storage.measure_write_speed(args.dir, 256 << 20) for _ in range(args.reps))
    print(f"write speed (fsynced) under {args.dir}: {speed / 1e6:.0f} MB/s")
    result = {
        "machine": platform.node(),
        "dir": str(args.dir),
        "write_mb_per_s": round(speed / 1e6, 1),
        "fsync": fsync_costs(args.dir / "ckpt", args.sizes_mb, args.ranks, args.reps),
        "launcher_grace_s": preemption.LAUNCHER_GRACE_S,
        "step_s": args.step_s,
        "sigterm_to_commit_tiny_s": args.sigterm_tiny_s,
        "predictions": predictions(speed, args.step_s),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
