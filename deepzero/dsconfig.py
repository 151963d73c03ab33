"""Load, validate and resolve a DeepSpeed JSON preset before anything heavy happens.

The one place that owns the batch math and every ``"auto"`` value. DeepSpeed ignores unknown top-level
keys and some of its sub-configs silently drop ``"auto"``; here every mistake is collected and raised once,
as one line naming the file, the keys and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepzero import precision as precision_mod
from deepzero.errors import UserError

# Top-level keys DeepSpeed understands (https://www.deepspeed.ai/docs/config-json/). Keys starting with "_"
# are comments (e.g. "_launch") and are removed before the config reaches DeepSpeed.
KNOWN_TOP_LEVEL = frozenset(
    [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "flops_profiler",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "autotuning",
        "elasticity",
        "data_efficiency",
        "curriculum_learning",
        "data_types",
        "checkpoint",
        "aio",
        "pipeline",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "compression_training",
        "sparse_attention",
        "disable_allgather",
        "dataloader_drop_last",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "nebula",
        "hybrid_engine",
        "compile",
        "timers",
        "use_data_before_expert_parallelism",
        "weight_quantization",
        "tensor_parallel",
        "sequence_parallel_size",
        "graph_harvesting",
        "zenflow",
    ]
)

ADAM_PARAMS = frozenset(["lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam"])
"""Keys every Adam takes; ``torch_adam`` also takes torch.optim.AdamW's ``fused`` / ``foreach``, DeepSpeed's own
Adams (FusedAdam, DeepSpeedCPUAdam) ``bias_correction`` (engine.py ``get_optimizer_configuration``)."""
TORCH_ADAM_ONLY = frozenset(["fused", "foreach"])
DEEPSPEED_ADAM_ONLY = frozenset(["bias_correction"])

SECTIONS = frozenset(
    [
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "zero_optimization",
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "autotuning",
        "elasticity",
        "data_efficiency",
        "curriculum_learning",
        "data_types",
        "checkpoint",
        "aio",
        "pipeline",
        "compression_training",
        "sparse_attention",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "nebula",
        "hybrid_engine",
        "compile",
        "timers",
        "weight_quantization",
        "tensor_parallel",
        "zenflow",
    ]
)
"""Top-level keys whose value is a JSON object (DeepSpeed calls ``.get`` / ``**`` on them)."""

OPTIMIZER_PARAMS = {
    "adam": ADAM_PARAMS | TORCH_ADAM_ONLY | DEEPSPEED_ADAM_ONLY,
    "adamw": ADAM_PARAMS | TORCH_ADAM_ONLY | DEEPSPEED_ADAM_ONLY,
    "sgd": {"lr", "momentum", "weight_decay", "nesterov", "dampening"},
    "lamb": {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff", "bias_correction"},
    "adagrad": {"lr", "eps", "weight_decay", "lr_decay"},
    "lion": {"lr", "betas", "weight_decay"},
}


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
DECAYING = ("WarmupDecayLR", "WarmupCosineLR")
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


def _typo_hint(key: str, known: frozenset[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else "remove it or check https://www.deepspeed.ai/docs/config-json/"


def _pydantic_problems(model: type, section: dict[str, Any], prefix: str) -> list[str]:
    """Validate a section with DeepSpeed's own pydantic model; list each bad key with a hint."""
    from pydantic import ValidationError

    try:
        model(**section)
    except ValidationError as err:
        fields = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        problems = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            key = f"{prefix}.{loc}"
            if e["type"] == "extra_forbidden":
                problems.append(f"unknown key '{key}' ({_typo_hint(str(e['loc'][-1]), fields)})")
            else:
                problems.append(f"'{key}': {e['msg']}")
        return problems
    return []


def _section_models() -> dict[str, type]:
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
    }


def _scheduler_params(name: str) -> set[str] | None:
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None)
    if cls is None or not inspect.isclass(cls):
        return None
    return {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer")}


def shape_problems(cfg: dict[str, Any]) -> list[str]:
    """Sections that are not JSON objects (checked first: everything after reads them as dicts)."""
    problems = [
        f"'{k}' must be a JSON object {{...}}, got {json.dumps(v)[:40]}"
        for k, v in cfg.items()
        if k in SECTIONS and not isinstance(v, dict)
    ]
    for section in ("optimizer", "scheduler"):
        node = cfg.get(section)
        if isinstance(node, dict):
            if not isinstance(node.get("params", {}), dict):
                problems.append(
                    f"'{section}.params' must be a JSON object {{...}}, got {json.dumps(node['params'])[:40]}"
                )
            if not isinstance(node.get("type"), str):
                problems.append(f"'{section}.type' must be a name (a string), got {json.dumps(node.get('type'))[:40]}")
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _scalar_problems(cfg: dict[str, Any]) -> list[str]:
    """Top-level numbers and dtype names that DeepSpeed stores unchecked and uses later (a TypeError mid-step)."""
    problems = []
    for key in ("gradient_clipping", "gradient_predivide_factor"):
        if key in cfg and not (_is_number(cfg[key]) and cfg[key] >= 0):
            problems.append(f"'{key}' must be a number >= 0, got {cfg[key]!r}")
    if "steps_per_print" in cfg and not (isinstance(cfg["steps_per_print"], int) and cfg["steps_per_print"] >= 1):
        problems.append(f"'steps_per_print' must be an integer >= 1, got {cfg['steps_per_print']!r}")
    for key, value in (cfg.get("data_types") or {}).items():
        if key.endswith("_dtype") and value not in (None, "fp32", "fp16", "bf16"):
            problems.append(f'\'data_types.{key}\' must be "fp32", "fp16" or "bf16", got {value!r}')
    return problems


def _optimizer_value_problems(params: dict[str, Any]) -> list[str]:
    """Values torch's and DeepSpeed's optimizers reject at construction (inside ``deepspeed.initialize``)."""
    problems = []
    for key in ("eps", "weight_decay", "momentum", "dampening", "lr_decay"):
        if key in params and not (_is_number(params[key]) and params[key] >= 0):
            problems.append(f"'optimizer.params.{key}' must be a number >= 0, got {params[key]!r}")
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
            problems.append(f"'optimizer.params.betas' must be two numbers in [0, 1), got {betas!r}")
    for key in ("amsgrad", "adam_w_mode", "torch_adam", "fused", "foreach", "bias_correction", "nesterov"):
        if key in params and not isinstance(params[key], bool):
            problems.append(f"'optimizer.params.{key}' must be true or false, got {params[key]!r}")
    return problems


def _scheduler_value_problems(name: str, params: dict[str, Any]) -> list[str]:
    """Each parameter typed like its default in DeepSpeed's schedule class, then the class itself on a dummy
    optimizer (it checks e.g. ``warmup_num_steps`` >= 1 only when ``deepspeed.initialize`` builds it)."""
    import torch
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name)
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    problems = []
    for key, value in params.items():
        default = defaults.get(key)
        if isinstance(default, str) and not isinstance(value, str):
            problems.append(f"'scheduler.params.{key}' must be a string like {default!r}, got {value!r}")
        elif (isinstance(default, int | float) or default is None) and not isinstance(default, bool):
            if not (_is_number(value) or (default is None and value is None)):
                problems.append(f"'scheduler.params.{key}' must be a finite number, got {value!r}")
            elif _is_number(value) and value < 0 and key != "last_batch_iteration":
                problems.append(f"'scheduler.params.{key}' must be >= 0, got {value!r}")
    if problems:
        return problems
    try:
        with _quiet(logging.getLogger("DeepSpeed")):
            cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), **params)
    except (ValueError, TypeError, KeyError, AssertionError) as err:
        problems.append(f"'scheduler.params' rejected by DeepSpeed's {name} ({err})")
    return problems


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Silence ``logger`` (DeepSpeed's schedules log a warning when built outside a run)."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def deepspeed_problems(cfg: dict[str, Any], batch: BatchMath) -> list[str]:
    """What DeepSpeed's own config parser (run by ``deepspeed.initialize``) raises for this config, if anything.

    It divides the batch by the world size it sees: 1 without a process group, the whole world inside one (a
    caller that resolves after ``init_distributed``). Its batch keys are set for that size, so it checks the rest;
    the batch math against the real data-parallel size is ours, :func:`resolve_batch`."""
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        seen_world = comm.get_world_size()
    except (RuntimeError, AssertionError, AttributeError):
        seen_world = 1
    seen_dp = seen_world // cfg.get("sequence_parallel_size", 1) if seen_world > 1 else 1  # DeepSpeed: world / SP
    as_seen = {**copy.deepcopy(cfg), "train_batch_size": batch.micro * batch.accum * seen_dp}
    try:
        DeepSpeedConfig(as_seen)
    except Exception as err:  # DeepSpeed raises AssertionError, ValueError, pydantic errors, ...
        return [f"DeepSpeed rejects it ({type(err).__name__}: {' '.join(str(err).split())[:200]})"]
    return []


def validate(cfg: dict[str, Any]) -> list[str]:
    """Every problem in a resolved config (no "auto" left), as short phrases naming the key."""
    problems = [f"unknown key '{k}' ({_typo_hint(k, KNOWN_TOP_LEVEL)})" for k in cfg if k not in KNOWN_TOP_LEVEL]
    for name, model in _section_models().items():
        if isinstance(cfg.get(name), dict):
            problems += _pydantic_problems(model, cfg[name], name)
    problems += _scalar_problems(cfg)
    if cfg.get("fp16", {}).get("enabled") and cfg.get("bf16", {}).get("enabled"):
        problems.append("both 'fp16.enabled' and 'bf16.enabled' are true (pick one)")
    problems += _accumulation_problems(cfg)
    if opt := cfg.get("optimizer"):
        lr = opt.get("params", {}).get("lr")
        if lr != "auto" and not (_is_number(lr) and lr > 0):
            problems.append(f"'optimizer.params.lr' must be a positive number, got {lr!r}")
        known = OPTIMIZER_PARAMS.get(str(opt.get("type", "")).lower())
        if known is None:
            problems.append(f"'optimizer.type' {opt.get('type')!r} is not one of {sorted(OPTIMIZER_PARAMS)}")
        else:
            for k in opt.get("params", {}):
                if k not in known:
                    problems.append(f"unknown key 'optimizer.params.{k}' ({_typo_hint(k, known)})")
            if str(opt.get("type", "")).lower() in ("adam", "adamw"):
                problems += _adam_problems(opt.get("params", {}))
            problems += _optimizer_value_problems(opt.get("params", {}))
    if sched := cfg.get("scheduler"):
        params = sched.get("params", {})
        warmup, total = params.get("warmup_num_steps"), params.get("total_num_steps")
        if sched.get("type") in DECAYING and isinstance(warmup, int) and isinstance(total, int) and warmup >= total:
            problems.append(
                f"'scheduler.params.warmup_num_steps' {warmup} leaves no steps to decay over (total {total}, from"
                " --max-steps)"
            )
        known = _scheduler_params(str(sched.get("type", "")))
        if known is None:
            problems.append(f"'scheduler.type' {sched.get('type')!r} is not a DeepSpeed LR schedule")
        else:
            unknown = [k for k in params if k not in known]
            problems += [f"unknown key 'scheduler.params.{k}' ({_typo_hint(k, known)})" for k in unknown]
            if not unknown:
                problems += _scheduler_value_problems(str(sched["type"]), params)
    return problems


def _accumulation_problems(cfg: dict[str, Any]) -> list[str]:
    """DeepSpeed accumulates 16-bit gradients in another dtype only inside a ZeRO optimizer (stage 1-3): stage 0
    with fp16/bf16 and a different ``data_types.grad_accum_dtype`` ends in its NotImplementedError."""
    sixteen = next((t for t in ("fp16", "bf16") if isinstance(cfg.get(t), dict) and cfg[t].get("enabled")), None)
    accum = cfg.get("data_types", {}).get("grad_accum_dtype") if isinstance(cfg.get("data_types"), dict) else None
    stage = cfg.get("zero_optimization", {}).get("stage", 0) if isinstance(cfg.get("zero_optimization"), dict) else 0
    if sixteen and accum not in (None, sixteen) and stage == 0:  # the pipeline too (measured: NotImplementedError)
        return [
            f"'data_types.grad_accum_dtype' {accum!r} with {sixteen} needs 'zero_optimization.stage' 1, 2 or 3"
            " (DeepSpeed accumulates in another dtype only inside ZeRO; set the stage, or drop 'data_types')"
        ]
    if sixteen == "bf16" and accum == "fp32" and "pipeline" in cfg and not cfg["bf16"].get("immediate_grad_update"):
        return [
            "'bf16.immediate_grad_update' must be true with the \"pipeline\" section and 'data_types.grad_accum_dtype'"
            " 'fp32' (without it DeepSpeed 0.19.8's BF16_Optimizer loses part of each step's gradient under the pipeline"
            " schedule: measured loss 6.27 -> 6.06 in 12 steps instead of 5.40; set it true, or accumulate in bf16)"
        ]
    return []


def _adam_problems(params: dict[str, Any]) -> list[str]:
    """Keys that only one of DeepSpeed's two Adam paths accepts (the other raises a TypeError in initialize)."""
    torch_adam = params.get("torch_adam") is True
    wrong = (DEEPSPEED_ADAM_ONLY if torch_adam else TORCH_ADAM_ONLY) & set(params)
    problems = [
        f"'optimizer.params.{k}' needs \"torch_adam\": {str(not torch_adam).lower()} (it is an option of "
        f"{'DeepSpeed' if torch_adam else 'torch'}'s AdamW)"
        for k in sorted(wrong)
    ]
    if params.get("fused") is True and params.get("foreach") is True:
        problems.append("'optimizer.params.fused' and 'optimizer.params.foreach' are both true (pick one)")
    return problems


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
    if peak is not None and peak != "auto" and not (_is_number(peak) and peak > 0):
        problems.append(f"'scheduler.params.{PEAK}' must be a positive number or \"auto\", got {peak!r}")
    if lr != "auto":
        source = _where("optimizer.params.lr", path, overrides)
    elif _is_number(peak) and peak > 0:
        params["lr"], source = peak, _where(f"scheduler.params.{PEAK}", path, overrides)
    else:
        params["lr"] = hints.default_lr or FINETUNE_LR
        source = f'{hints.default_lr_source} (optimizer.params.lr "auto" in {path})'
    if peak == "auto":
        sched[PEAK] = params["lr"]
    elif lr != "auto" and _is_number(lr) and _is_number(peak) and peak > 0 and not math.isclose(lr, peak):
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
        problems += deepspeed_problems(cfg, batch)
    if problems:
        fixes.append("edit the file or override with --ds key=value")
        raise UserError(str(path), "; ".join(problems), "; ".join(dict.fromkeys(fixes)))
    requested = precision_mod.requested_precision(cfg)
    choice = precision_mod.decide(requested, str(path), precision, kernels or precision_mod.probe())
    precision_mod.apply(cfg, choice.dtype)
    return ResolvedConfig(str(path), cfg, batch, choice, lr_source)
