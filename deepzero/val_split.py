"""The val split a run evaluates on: opened and checked against the vocabulary, or off (one warning line) when it
cannot fill one evaluation round."""

from __future__ import annotations

from typing import Any

from deepzero import dsconfig
from deepzero.args import TrainArgs
from deepzero.data import PackedDataset, open_split
from deepzero.errors import warn


def usable(
    args: TrainArgs, meta: dict[str, Any], batch: dsconfig.BatchMath, vocab_size: int | None = None
) -> PackedDataset | None:
    """The val split (its ids checked against ``vocab_size`` as read), or None (with a warning) when it cannot
    fill one evaluation round."""
    if not meta["n_rows"].get("val"):
        return None
    val_data = open_split(args.data, "val", documents=args.packing == "documents", vocab_size=vocab_size)
    per, what = batch.micro, f"micro {batch.micro}"
    if meta.get("format") == "prompts":  # GRPO's eval micro-batch counts prompts, each sampled G_eval times
        g = 1 if args.eval_sampling == "greedy" else (args.num_generations_eval or args.num_generations)
        per, what = max(1, batch.micro // g), f"{max(1, batch.micro // g)} prompt(s): micro {batch.micro} ÷ {g} samples"
    if args.eval_interval and len(val_data) < per * batch.dp_size:
        unit = "prompts" if meta.get("format") == "prompts" else "rows"
        warn(
            f"{args.data}: val split has {len(val_data)} {unit}, fewer than one eval round ({what}"
            f" × data-parallel {batch.dp_size}); evaluation is off. Fix: prepare with a larger --val-fraction"
        )
        return None
    return val_data
