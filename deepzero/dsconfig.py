"""Load and resolve a DeepSpeed JSON preset before anything heavy happens.

The one place that owns the batch math and every ``"auto"`` value. DeepSpeed ignores unknown top-level
keys and some of its sub-configs silently drop ``"auto"``; here every mistake (the checks themselves:
``deepzero.dsconfig_checks``) is collected and raised once, as one line naming the file, the keys and the fix.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepzero import precision as precision_mod
from deepzero.dsconfig_checks import deepspeed_problems, is_number, shape_problems, validate
from deepzero.errors import UserError


@dataclass(frozen=True)
class BatchMath:
    """micro × accumulation × data-parallel size = global; computed in one place and logged at start."""

    micro: int
    accum: int
    dp_size: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    def describe(self, seq_len: int | None = None) -> str:
        tokens = f" = {self.global_batch * seq_len:,} tokens/step" if seq_len else ""
        return (
            f"batch: micro {self.micro} × accumulation {self.accum} × data-parallel {self.dp_size}"
            f" = global {self.global_batch} sequences{tokens}"
        )


@dataclass(frozen=True)
class TrainingHints:
    """Values the training run supplies to fill "auto" entries (and the CLI overrides)."""

    max_steps: int
    lr: float | None = None
    """``--lr``: the optimizer lr and the schedule's peak, whatever the JSON says."""
    default_lr: float | None = None
    """What ``"lr": "auto"`` trains at: the model preset's lr (None: :data:`FINETUNE_LR`)."""
    default_lr_source: str = "the fine-tuning default"
    """Where ``default_lr`` comes from, for the run header and run_config.json."""
    warmup_steps: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    hidden_size: int | None = None
    lr_schedule: str | None = None
    """``--lr-schedule``: replace the preset's scheduler with one of :data:`LR_SCHEDULES`."""


LR_SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto"}},
    "cosine": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": "auto", "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1},
    },
    "linear": {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": "auto", "warmup_min_lr": 0, "warmup_max_lr": "auto"},
    },
}
"""DeepSpeed's schedules behind ``--lr-schedule``: linear warm-up, then constant, cosine down to 0.1 × the peak, or
linear down to 0 at ``--max-steps`` (``total_num_steps``)."""
FINETUNE_LR = 3e-5
"""What ``"lr": "auto"`` trains a real checkpoint at (a random-init model preset brings its own pretraining lr)."""
PEAK = "warmup_max_lr"
"""The schedule's peak: DeepSpeed's WarmupLR and WarmupDecayLR write it over the optimizer's lr."""


def replace_schedule(cfg: dict[str, Any], name: str, lr: Any = "auto") -> None:
    """Swap the config's scheduler for ``LR_SCHEDULES[name]``, keeping its warm-up length; its peak is ``lr``."""
    old = (cfg.get("scheduler") or {}).get("params", {})
    params = {**LR_SCHEDULES[name]["params"], "warmup_num_steps": old.get("warmup_num_steps", "auto")}
    if PEAK in params:
        params[PEAK] = lr
    cfg["scheduler"] = {"type": LR_SCHEDULES[name]["type"], "params": {**params, "warmup_type": "linear"}}


OWNED_SECTIONS = ("preference", "quantization")
"""Preset sections that deepzero reads itself (the preference loss: ``deepzero.losses.objectives``; the 4-bit base:
``deepzero.adapters.quant``); removed from
the config before it is validated and handed to DeepSpeed."""


def owned_section(path: str | Path, overrides: list[str] | tuple[str, ...], name: str) -> Any:
    """The preset's ``name`` section after the ``--ds`` overrides (None when absent)."""
    raw = load_json(path)
    apply_overrides(raw, list(overrides), str(path))
    return raw.get(name)


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON preset; a missing file or a syntax error becomes one clear line."""
    path = Path(path)
    if not path.is_file():
        presets = ", ".join(sorted(p.name for p in Path("ds_configs").glob("*.json"))) or "ds_configs/*.json"
        raise UserError(str(path), "DeepSpeed config not found", f"pass --deepspeed_config with one of: {presets}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}:{e.lineno}:{e.colno}", f"invalid JSON ({e.msg})", "fix the syntax (no comments or trailing commas)"
        ) from None
    if not isinstance(data, dict):
        raise UserError(str(path), "top level must be a JSON object", 'write {"train_micro_batch_size_per_gpu": ...}')
    return data


def apply_overrides(cfg: dict[str, Any], overrides: list[str], source: str) -> None:
    """Apply ``dotted.key=value`` overrides in place (value parsed as JSON, else kept as a string)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(
                f"--ds {item}", "override must look like key.sub=value", "e.g. --ds zero_optimization.stage=3"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"{source} --ds {item}", f"{part} is not a section", "override a leaf key")
        node[leaf] = value


def resolve_batch(cfg: dict[str, Any], dp_size: int, hints: TrainingHints) -> BatchMath:
    """Fill and check the three batch keys against the real data-parallel size. Never floors silently."""
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        value = _int_or_none(cfg.get(key))
        if value is not None and value < 1:
            raise _BatchError(f"'{key}' must be at least 1, got {value}", f'set "{key}" to 1 or more, or to "auto"')
    micro = hints.micro_batch or _int_or_none(cfg.get("train_micro_batch_size_per_gpu"))
    accum = hints.grad_accum or _int_or_none(cfg.get("gradient_accumulation_steps"))
    total = None if (hints.micro_batch or hints.grad_accum) else _int_or_none(cfg.get("train_batch_size"))
    if micro is None and accum is None and total is None:
        micro, accum = 1, 1
    if micro is None:
        micro = _divide(total, (accum or 1) * dp_size, "train_micro_batch_size_per_gpu", dp_size, accum or 1)
    if accum is None:
        accum = 1 if total is None else _divide(total, micro * dp_size, "gradient_accumulation_steps", dp_size, micro)
    batch = BatchMath(micro, accum, dp_size)
    if total is not None and total != batch.global_batch:
        raise _BatchError(
            f"train_batch_size {total} != micro {micro} × gradient_accumulation_steps {accum} × world size {dp_size}"
            f" (= {batch.global_batch})",
            f'set "train_batch_size": {batch.global_batch} or "auto"',
        )
    cfg.update(
        train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=batch.global_batch
    )
    return batch


class _BatchError(Exception):
    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def _int_or_none(value: Any) -> int | None:
    return None if value in (None, "auto") else int(value)


def _divide(total: int, by: int, key: str, dp_size: int, other: int) -> int:
    if total % by:
        candidates = [total - total % by, total - total % by + by]
        raise _BatchError(
            f"train_batch_size {total} is not divisible by world size {dp_size} × {other} (needed to derive {key})",
            f'set "train_batch_size" to {" or ".join(str(c) for c in candidates if c > 0)}, or to "auto"',
        )
    return total // by


def _where(key: str, path: str, overrides: list[str]) -> str:
    """Who set ``key``: the last ``--ds`` override of it (or of a section above it), else the file."""
    for item in reversed(overrides):
        name = item.partition("=")[0]
        if key == name or key.startswith(f"{name}."):
            return f"--ds {name}"
    return f"{path} {key}"


def resolve_lr(cfg: dict[str, Any], hints: TrainingHints, path: str, overrides: list[str]) -> tuple[str, list[str]]:
    """Make the optimizer's lr and the schedule's peak one number; return where it came from and any conflict.

    ``--lr`` sets both. Otherwise a number the user wrote wins: the lr, else the peak; ``"auto"`` in both (the
    shipped presets) means the model preset's default (``hints.default_lr``, else :data:`FINETUNE_LR`). A peak that
    disagrees with a written lr is a problem: DeepSpeed would silently train at the peak."""
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict):
        return "no optimizer section", []
    params = opt.setdefault("params", {})
    sched = cfg.get("scheduler", {}).get("params", {})
    if hints.lr is not None:
        params["lr"] = hints.lr
        if PEAK in sched:
            sched[PEAK] = hints.lr
        return "--lr", []
    lr, peak = params.setdefault("lr", "auto"), sched.get(PEAK)
    problems = []
    if peak is not None and peak != "auto" and not (is_number(peak) and peak > 0):
        problems.append(f"'scheduler.params.{PEAK}' must be a positive number or \"auto\", got {peak!r}")
    if lr != "auto":
        source = _where("optimizer.params.lr", path, overrides)
    elif is_number(peak) and peak > 0:
        params["lr"], source = peak, _where(f"scheduler.params.{PEAK}", path, overrides)
    else:
        params["lr"] = hints.default_lr or FINETUNE_LR
        source = f'{hints.default_lr_source} (optimizer.params.lr "auto" in {path})'
    if peak == "auto":
        sched[PEAK] = params["lr"]
    elif lr != "auto" and is_number(lr) and is_number(peak) and peak > 0 and not math.isclose(lr, peak):
        by_cli = [
            " (--ds)" if _where(k, path, overrides).startswith("--ds") else ""
            for k in ("optimizer.params.lr", f"scheduler.params.{PEAK}")
        ]
        problems.append(
            f"'optimizer.params.lr' {lr:g}{by_cli[0]} and 'scheduler.params.{PEAK}' {peak:g}{by_cli[1]} disagree"
            " (the schedule's peak would win)"
        )
    return source, problems


def fill_auto(cfg: dict[str, Any], hints: TrainingHints) -> list[str]:
    """Replace every "auto" left after :func:`resolve_lr` (and apply --warmup-steps); return keys still "auto" that
    we cannot fill."""
    sched = cfg.get("scheduler", {}).get("params", {})
    values = {
        "gradient_clipping": 1.0,
        "warmup_num_steps": hints.warmup_steps,
        "total_num_steps": hints.max_steps,
    }
    if hints.warmup_steps is not None and "warmup_num_steps" in sched:
        sched["warmup_num_steps"] = hints.warmup_steps
    if "total_num_steps" in sched:
        sched["total_num_steps"] = hints.max_steps
    if sched.get("warmup_num_steps") == "auto" and hints.warmup_steps is None:
        values["warmup_num_steps"] = max(1, hints.max_steps // 20)
    if h := hints.hidden_size:
        values |= {
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        }
    unresolved: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
            elif value == "auto":
                if values.get(key) is not None:
                    node[key] = values[key]
                elif key not in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
                    unresolved.append(path)

    walk(cfg, "")
    return unresolved


@dataclass(frozen=True)
class ResolvedConfig:
    """A DeepSpeed config ready for ``deepspeed.initialize``, plus what the loop needs to know about it."""

    path: str
    ds: dict[str, Any]
    batch: BatchMath
    precision_choice: precision_mod.Precision
    """The training precision decided against the device (the ds config's fp16/bf16 sections follow it)."""
    lr_source: str = ""
    """Where the optimizer's lr (and the schedule's peak) came from (:func:`resolve_lr`)."""

    @property
    def precision(self) -> str:
        return self.precision_choice.dtype

    @property
    def zero_stage(self) -> int:
        return int(self.ds.get("zero_optimization", {}).get("stage", 0))

    @property
    def is_pipeline(self) -> bool:
        return "pipeline" in self.ds

    @property
    def offload(self) -> list[str]:
        zero = self.ds.get("zero_optimization", {})
        return [
            what
            for what in ("optimizer", "param")
            if (zero.get(f"offload_{what}") or {}).get("device", "none") not in ("none", None)
        ]


def resolve(
    path: str | Path,
    dp_size: int,
    hints: TrainingHints,
    overrides: list[str] | tuple[str, ...] = (),
    precision: str | None = None,
    kernels: precision_mod.DeviceKernels | None = None,
) -> ResolvedConfig:
    """Load, override, fill "auto", check batch math against ``dp_size`` and validate; raise once, listing all.
    Then decide the precision: the preset's (or ``precision``, from --precision) against ``kernels`` (default: this
    process's device, probed)."""
    raw = load_json(path)
    cfg = copy.deepcopy({k: v for k, v in raw.items() if not k.startswith("_")})
    apply_overrides(cfg, list(overrides), str(path))
    for name in OWNED_SECTIONS:  # read by deepzero (owned_section), never by DeepSpeed
        cfg.pop(name, None)
    if problems := shape_problems(cfg):
        raise UserError(str(path), "; ".join(problems), "edit the file or override with --ds key=value")
    problems, fixes = [], []
    try:
        batch = resolve_batch(cfg, dp_size, hints)
    except _BatchError as err:
        problems.append(err.problem)
        fixes.append(err.fix)
        batch = BatchMath(1, 1, dp_size)
    except (TypeError, ValueError) as err:
        problems.append(f'batch keys must be integers or "auto" ({err})')
        batch = BatchMath(1, 1, dp_size)
    lr_source, lr_problems = resolve_lr(cfg, hints, str(path), list(overrides))
    if lr_problems:
        problems += lr_problems
        fixes.append(f'set "scheduler.params.{PEAK}": "auto" (it follows the lr) or a positive number equal to the lr')
    if hints.lr_schedule is not None:
        replace_schedule(cfg, hints.lr_schedule, cfg.get("optimizer", {}).get("params", {}).get("lr", "auto"))
    unresolved = fill_auto(cfg, hints)
    problems += [f"'{k}' is \"auto\" but nothing can fill it" for k in unresolved]
    if unresolved:
        fixes.append("give a number")
    problems += validate(cfg)
    if not problems:
        problems += deepspeed_problems(cfg, batch.micro, batch.accum)
    if problems:
        fixes.append("edit the file or override with --ds key=value")
        raise UserError(str(path), "; ".join(problems), "; ".join(dict.fromkeys(fixes)))
    requested = precision_mod.requested_precision(cfg)
    choice = precision_mod.decide(requested, str(path), precision, kernels or precision_mod.probe())
    precision_mod.apply(cfg, choice.dtype)
    return ResolvedConfig(str(path), cfg, batch, choice, lr_source)
