"""How long a run trains and how its learning rate gets to the peak: ``--epochs``, ``--warmup-ratio``, the default
lr of a LoRA run, and the one-line warning when a schedule never reaches its peak.

- ``--epochs E``: steps = ceil(E × samples / samples per step), where a step takes the global batch (sequences or
  preference pairs) or, for GRPO, global batch ÷ ``--num-generations`` prompts (TRL counts a GRPO batch in
  completions). It replaces ``--max-steps``.
- ``--warmup-ratio R``: ceil(R × steps) warm-up steps, as Transformers' ``TrainingArguments.get_warmup_steps``.
- A fine-tune of a checkpoint (anything but a random-init preset) whose preset schedules ``WarmupLR`` (constant after
  the warm-up, as the shipped presets do) decays by cosine to 0.1 × the peak at the last step
  (:data:`FINETUNE_SCHEDULE`), as TRL's and Transformers' fine-tunes decay (theirs linearly to 0 by default);
  ``--lr-schedule constant`` keeps the preset's. A decaying scheduler written in the preset is kept, and so is
  ``WarmupLR`` when its warm-up fills the run (which :func:`never_peaks` reports).
- LoRA: ``"lr": "auto"`` is 2e-4 for SFT, pre-training and preference tuning (the QLoRA paper's and TRL's LoRA
  examples' lr for 7B-70B) and 1e-5 for GRPO (TRL's "LoRA without regret" guide: about ten times the full fine-tune's
  1e-6); a full fine-tune of a checkpoint keeps 3e-5 (GRPO: TRL's 1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepzero.args import TrainArgs
from deepzero.dsconfig import ResolvedConfig, TrainingHints
from deepzero.errors import UserError

FINETUNE_SCHEDULE = "cosine"
"""What a fine-tune's ``WarmupLR`` preset becomes unless ``--lr-schedule`` says otherwise."""
LORA_LR = 2e-4
LORA_GRPO_LR = 1e-5


@dataclass(frozen=True)
class Steps:
    """The run's optimizer steps and warm-up."""

    max_steps: int
    warmup_steps: int | None


def lora_default_lr(grpo: bool) -> tuple[float, str]:
    """What ``"lr": "auto"`` trains a LoRA/QLoRA run at, and why."""
    if grpo:
        return LORA_GRPO_LR, "the LoRA GRPO default (TRL's LoRA guide: ~10x the full fine-tune's 1e-6)"
    return LORA_LR, "the LoRA default (QLoRA paper and TRL's LoRA examples)"


def steps(
    max_steps: int,
    warmup_steps: int | None,
    epochs: float | None,
    warmup_ratio: float | None,
    meta: dict[str, Any],
    global_batch: int,
    num_generations: int | None,
) -> Steps:
    """The run's steps from ``--epochs`` (else ``--max-steps``) and its warm-up from ``--warmup-ratio`` (else
    ``--warmup-steps``); ``meta`` is the data's meta.json."""
    if warmup_steps is not None and warmup_ratio is not None:
        raise UserError("--warmup-ratio", "given with --warmup-steps", "pass one of them")
    if epochs is not None:
        per_step = max(1, global_batch // num_generations) if num_generations else global_batch
        samples = int(meta["n_rows"]["train"]) // (2 if meta.get("format") == "preference" else 1)
        max_steps = max(1, math.ceil(epochs * samples / per_step))
    if warmup_ratio is not None:
        warmup_steps = math.ceil(warmup_ratio * max_steps)
    return Steps(max_steps, warmup_steps)


def resolve_steps(
    args: TrainArgs,
    hints: TrainingHints,
    meta: dict[str, Any],
    num_generations: int | None,
    resolve: Callable[[TrainingHints], ResolvedConfig],
    fine_tune: bool = False,
) -> tuple[ResolvedConfig, int]:
    """The config ``resolve(hints)`` gives for the run's steps, and those steps. With ``--epochs`` or
    ``--warmup-ratio`` the steps need the global batch, so the config is resolved twice: first for the batch alone (no
    schedule to check against a step count not yet known), then with the steps and warm-up. A ``fine_tune`` of a
    ``WarmupLR`` preset without ``--lr-schedule`` is resolved once more with :data:`FINETUNE_SCHEDULE` (unless its
    warm-up fills the run: :func:`never_peaks` then warns)."""
    max_steps = hints.max_steps
    if args.epochs is not None or args.warmup_ratio is not None:
        batch = resolve(dataclasses.replace(hints, max_steps=2**31 - 1)).batch
        planned = steps(
            hints.max_steps,
            args.warmup_steps,
            args.epochs,
            args.warmup_ratio,
            meta,
            batch.global_batch,
            num_generations,
        )
        warmup = planned.warmup_steps or hints.warmup_steps  # a random-init preset's own warm-up, unless a ratio
        hints = dataclasses.replace(hints, max_steps=planned.max_steps, warmup_steps=warmup)
        max_steps = planned.max_steps
    cfg = resolve(hints)
    scheduler = cfg.ds.get("scheduler") or {}
    warmup = scheduler.get("params", {}).get("warmup_num_steps", 0)
    room = not isinstance(warmup, int) or warmup < max_steps  # else never_peaks says so
    if fine_tune and args.lr_schedule is None and scheduler.get("type") == "WarmupLR" and room:
        cfg = resolve(dataclasses.replace(hints, lr_schedule=FINETUNE_SCHEDULE))
        why = f"{FINETUNE_SCHEDULE} decay, the fine-tuning default (--lr-schedule constant keeps the preset's WarmupLR)"
        cfg = dataclasses.replace(cfg, lr_source=f"{cfg.lr_source}; {why}")
    return cfg, max_steps


def kept_on_resume(args: TrainArgs) -> bool:
    """Whether a resumed run keeps the preset's ``WarmupLR`` its checkpoints trained with (a run started with
    ``--lr-schedule constant``, or before fine-tunes decayed by default): without ``--lr-schedule``, switching to
    :data:`FINETUNE_SCHEDULE` mid-run would drop the lr at once."""
    path = args.out_dir / "run_config.json"
    if not args.resume or args.lr_schedule is not None or not path.is_file():
        return False
    scheduler = json.loads(path.read_text()).get("deepspeed", {}).get("scheduler") or {}
    return scheduler.get("type") == "WarmupLR"


def never_peaks(scheduler: dict[str, Any] | None, max_steps: int) -> str | None:
    """A warning line when the schedule's warm-up is not over before the run ends, else None."""
    params = (scheduler or {}).get("params", {})
    warmup = params.get("warmup_num_steps")
    if not isinstance(warmup, int) or warmup < max_steps:
        return None
    share = ""
    if params.get("warmup_type", "log") == "linear":
        share = f" (the lr ends at {max_steps / warmup:.0%} of its peak)"
    return (
        f"lr: the warm-up ({warmup} steps) is not over by the run's last step ({max_steps}), so the schedule never"
        f" reaches its peak{share}. Fix: pass --warmup-ratio 0.03 (or --warmup-steps N below {max_steps})"
    )
