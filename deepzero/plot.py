"""Loss curves and throughput from a run's metrics.jsonl, as one PNG (matplotlib, no display needed).

    python -m deepzero.plot runs/default/metrics.jsonl                    # writes runs/default/curves.png
    python -m deepzero.plot runs/default/metrics.jsonl -o /tmp/curves.png

Left: train loss (one point per log window) and validation loss against the optimizer step. Right: tokens/s
against the step; the first log window, which includes warm-up, is drawn hollow and left out of the median line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from deepzero.errors import UserError
from deepzero.metrics import read_jsonl


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over records of ``kind``, skipping missing and non-finite values."""
    points = [
        (r["step"], float(r[key]))
        for r in records
        if r.get("kind") == kind and isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]
    return [s for s, _ in points], [v for _, v in points]


def plot(metrics: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``metrics`` (a metrics.jsonl) to ``out`` (default: curves.png next to it); return the PNG's path."""
    metrics = Path(metrics)
    if not metrics.is_file():
        raise UserError(str(metrics), "no such metrics file", "pass the metrics.jsonl of a run (runs/<name>/)")
    records = read_jsonl(metrics)
    steps, loss = _series(records, "train", "loss")
    if not steps:
        raise UserError(str(metrics), "has no train records with a loss", "train for at least --log-interval steps")
    val_steps, val_loss = _series(records, "eval", "val_loss")
    tps_steps, tps = _series(records, "train", "tokens_per_s")
    out = Path(out) if out is not None else metrics.with_name("curves.png")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ax_loss.plot(steps, loss, marker=".", label="train")
    if val_steps:
        ax_loss.plot(val_steps, val_loss, marker="o", linestyle="--", label="val")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if tps_steps:
        ax_tps.plot(tps_steps[1:], tps[1:], marker=".", color="tab:green", label="tokens/s")
        first = {"marker": "o", "fillstyle": "none", "color": "tab:green", "linestyle": "none"}
        ax_tps.plot(tps_steps[:1], tps[:1], label="first window (warm-up)", **first)
        if len(tps) > 1:
            median = statistics.median(tps[1:])
            ax_tps.axhline(median, color="gray", linestyle=":", label=f"median {median:,.0f}")
        ax_tps.legend()
    ax_tps.set(xlabel="optimizer step", ylabel="tokens/s (all ranks)", title="Throughput")
    ax_tps.grid(alpha=0.3)
    fig.suptitle(str(metrics.parent.name or metrics))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot loss and tokens/s from a metrics.jsonl.")
    parser.add_argument("metrics", help="A run's metrics.jsonl (runs/<name>/metrics.jsonl).")
    parser.add_argument("-o", "--out", default=None, help="PNG to write (default: curves.png next to the metrics).")
    args = parser.parse_args(argv)
    try:
        path = plot(args.metrics, args.out)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
