"""Loss curves and throughput from a run's metrics.jsonl, as one PNG (matplotlib, no display needed).

    python -m deepzero.plot runs/default/metrics.jsonl                    # writes runs/default/curves.png
    python -m deepzero.plot runs/default/metrics.jsonl -o /tmp/curves.png

Left: train loss (one point per log window) and validation loss against the optimizer step. Middle: tokens/s
against the step; the first log window, which includes warm-up, is drawn hollow and left out of the median line.
For MoE runs (train records with ``expert_load``), two more panels: ``expert_load_imbalance`` (max/mean tokens per
expert) against the step, and the last log window's tokens per expert relative to the layer's mean as a heatmap,
one row per MoE layer (1 = balanced). For preference runs (train records with ``rewards/margins``), one more
panel: the rewards of the chosen and rejected answers, their margin and the reward accuracy, train and val. For
GRPO runs (train records with TRL's ``reward``), one more: the mean reward with its std band, each reward's mean
(``rewards/<name>/mean``), the val reward, and on its own axis ``val_pass@1`` (and ``val_cons@k``) where the run
evaluated; and (train records with ``timing/generation_s``) each logged step's wall time split into generation,
scoring, reference log-probs and training, stacked.
"""

from __future__ import annotations

import argparse
import itertools
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
    loads = [r for r in records if r.get("kind") == "train" and r.get("expert_load")]
    out = Path(out) if out is not None else metrics.with_name("curves.png")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = any(r.get("kind") == "train" and "rewards/margins" in r for r in records)
    grpo = any(r.get("kind") == "train" and "reward" in r for r in records)
    phases = [r for r in records if r.get("kind") == "train" and "timing/generation_s" in r]
    panels = 2 + 2 * bool(loads) + rewards + grpo + bool(phases)
    fig, axes = plt.subplots(1, panels, figsize=(5.25 * panels, 4), constrained_layout=True, squeeze=False)
    axes = axes[0]
    ax_loss, ax_tps = axes[0], axes[1]
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
    if loads:
        _expert_panels(fig, axes[2], axes[3], loads, _series(records, "train", "expert_load_imbalance"))
    if rewards:
        _reward_panel(axes[2 + 2 * bool(loads)], records)
    if grpo:
        grpo_reward_panel(axes[2 + 2 * bool(loads) + rewards], records)
    if phases:
        _phase_panel(axes[-1], phases)
    fig.suptitle(str(metrics.parent.name or metrics))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _expert_panels(
    fig: Any, ax_curve: Any, ax_map: Any, loads: list[dict[str, Any]], imbalance: tuple[list[int], list[float]]
) -> None:
    """The imbalance curve, and the last window's per-layer expert loads (relative to the layer's mean)."""
    steps, values = imbalance
    ax_curve.plot(steps, values, marker=".", color="tab:red", label="max / mean tokens per expert")
    ax_curve.axhline(1.0, color="gray", linestyle=":", label="balanced")
    ax_curve.set(xlabel="optimizer step", ylabel="expert load imbalance", title="Router balance (mean of layers)")
    ax_curve.grid(alpha=0.3)
    ax_curve.legend()
    last = loads[-1]
    rows = last["expert_load"]
    image = ax_map.imshow(rows, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    fig.colorbar(image, ax=ax_map, label="tokens / layer mean")
    ax_map.set_yticks(range(len(rows)))
    ax_map.set(xlabel="expert", ylabel="MoE layer", title=f"Expert load, window ending at step {last['step']}")


def _reward_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    """A preference run's rewards as TRL names them: chosen, rejected and margin (left axis), reward accuracy
    (right axis), train per log window and val at each evaluation."""
    for key, color in (("rewards/chosen", "tab:blue"), ("rewards/rejected", "tab:orange"), ("rewards/margins", "k")):
        ax.plot(*_series(records, "train", key), marker=".", color=color, label=key)
        if (val := _series(records, "eval", f"val_{key}"))[0]:
            ax.plot(*val, marker="o", linestyle="--", color=color, label=f"val {key}")
    ax.set(xlabel="optimizer step", ylabel="reward (beta x log-ratio)", title="Preference rewards")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(*_series(records, "train", "rewards/accuracies"), color="tab:green", marker="x", label="accuracy")
    if (val := _series(records, "eval", "val_rewards/accuracies"))[0]:
        twin.plot(*val, color="tab:green", marker="s", linestyle="--", label="val accuracy")
    twin.set(ylabel="reward accuracy", ylim=(0, 1.05))
    handles = [h for a in (ax, twin) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, fontsize="small", loc="upper left")


def grpo_reward_panel(ax: Any, records: list[dict[str, Any]]) -> Any:
    """A GRPO run's rewards as TRL names them: the mean reward per log window with a band of ± its std across
    completions (``reward``, ``reward_std``), each reward function's mean (``rewards/<name>/mean``) and the val reward
    at each evaluation (left axis); ``val_pass@1`` and ``val_cons@k`` on a right axis of their own when the run
    evaluated (returned; None otherwise)."""
    steps, mean = _series(records, "train", "reward")
    ax.plot(steps, mean, marker=".", color="k", label="reward")
    spread = dict(zip(*_series(records, "train", "reward_std"), strict=True))
    band = [(s, m, spread[s]) for s, m in zip(steps, mean, strict=True) if s in spread]
    if band:
        low = [m - sd for _, m, sd in band]
        high = [m + sd for _, m, sd in band]
        ax.fill_between([s for s, _, _ in band], low, high, color="gray", alpha=0.25, label="reward ± std")
    names = sorted({k for r in records if r.get("kind") == "train" for k in r if _per_reward(k)})
    for key in names:
        ax.plot(*_series(records, "train", key), marker=".", linewidth=1, label=key)
    if (val := _series(records, "eval", "val_reward"))[0]:
        ax.plot(*val, marker="o", linestyle="--", color="k", label="val reward")
    ax.set(xlabel="optimizer step", ylabel="reward (mean of completions)", title="GRPO rewards")
    ax.grid(alpha=0.3)
    scores = {k for r in records if r.get("kind") == "eval" for k in r if k.startswith(("val_pass@", "val_cons@"))}
    scores = [k for k in sorted(scores, key=lambda k: (k != "val_pass@1", k)) if _series(records, "eval", k)[0]]
    twin = None
    if scores:
        twin = ax.twinx()
        for key, color in zip(scores, itertools.cycle(("tab:green", "tab:purple", "tab:brown", "tab:olive"))):
            style = "-" if key == "val_pass@1" else ":"
            twin.plot(*_series(records, "eval", key), marker="s", linestyle=style, color=color, label=key[4:])
        twin.set(ylabel="val pass@1 / cons@k", ylim=(0, 1.05))
    handles = [h for a in (ax, twin) if a is not None for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, fontsize="small", loc="upper left")
    return twin


def _per_reward(key: str) -> bool:
    """``rewards/<name>/mean``: one reward function's mean (GRPO; a preference run's ``rewards/chosen`` is not)."""
    return key.startswith("rewards/") and key.endswith("/mean") and key.count("/") >= 2


PHASES = ("generation", "scoring", "reference", "train")
"""GRPO's step phases (``timing/<phase>_s``, deepzero.losses.grpo.metrics.PhaseTimer and the rest of the step)."""


def _phase_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    """A GRPO run's mean seconds per step in each phase, per log window, stacked."""
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    width = 0.8 * min((b - a for a, b in itertools.pairwise(steps)), default=1)
    for phase in PHASES:
        values = [float(r.get(f"timing/{phase}_s", 0.0)) for r in records]
        ax.bar(steps, values, width=width, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="optimizer step", ylabel="seconds per step (mean of ranks)", title="GRPO step phases")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")


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
