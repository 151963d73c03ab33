"""The run's typed configuration: one dataclass, parsed from the command line, checked once."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from deepzero.errors import UserError

DEFAULT_DATA = "artifacts/data/stdlib"
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""Transformers' built-in attention implementations (a hub kernel, ``org/name``, is passed through)."""


def _help(text: str, **kw) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass
class TrainArgs:
    """Everything a training run needs besides the DeepSpeed JSON (which owns batch, optimizer and precision)."""

    config: str | None = field(
        default=None,
        **_help(
            "A recipe: a YAML or JSON mapping of these flags (recipes/*.yaml; keys as the flags, - or _); flags given"
            " on the command line override it, unknown keys are refused."
        ),
    )
    deepspeed_config: str = field(
        default="ds_configs/zero2.json", **_help("DeepSpeed JSON preset (ds_configs/*.json).")
    )
    model: str = field(
        default="tiny-deepseek-v3",
        **_help("A preset name (see deepzero.presets), a local folder, or a Hugging Face hub id."),
    )
    tokenizer: str | None = field(
        default=None, **_help("Tokenizer folder or hub id. Default: the one the data was prepared with, else --model.")
    )
    allow_tokenizer_change: bool = field(
        default=False,
        **_help(
            "Train on data whose tokenizer is not --model's own (a deliberate change of vocabulary). Default: refused,"
            " the ids would mean other tokens."
        ),
    )
    data: str = field(
        default=DEFAULT_DATA, **_help("Folder written by data/prepare.py (meta.json and its train-*/val-* shards).")
    )
    out: str = field(default="runs/default", **_help("Run folder: metrics.jsonl, checkpoints/, hf/ export."))
    max_steps: int = field(default=200, **_help("Optimizer steps to train for (not micro-steps)."))
    lr: float | None = field(
        default=None,
        **_help(
            "Peak lr: sets optimizer.params.lr and the scheduler's warmup_max_lr, whatever the JSON says. Default: the"
            " JSON's lr; \"auto\" there (the shipped presets) is the model preset's pretraining lr for a random-init"
            " preset, else 3e-5. The run header says which lr won and where it came from."
        ),
    )
    epochs: float | None = field(
        default=None,
        **_help(
            "Train this many passes over the train split instead of --max-steps (steps from the data and the global"
            " batch; GRPO: batch / --num-generations prompts a step). See docs/schedules.md."
        ),
    )
    warmup_steps: int | None = field(default=None, **_help("Override the scheduler's warmup_num_steps."))
    replaced: list[str] = field(default_factory=list, init=False)
    """The recipe values (``--config``) the command line replaced, for the header; not a flag."""
    warmup_ratio: float | None = field(
        default=None,
        **_help("Warm-up as a share of the run's steps (ceil(ratio x steps), as TRL's warmup_ratio); e.g. 0.03."),
    )
    lr_schedule: Literal["constant", "cosine", "linear"] | None = field(
        default=None,
        **_help(
            "Replace the preset's LR scheduler (warm-up kept): constant (WarmupLR), cosine (WarmupCosineLR, down to"
            " 0.1 × the peak at --max-steps) or linear (WarmupDecayLR, down to 0). Default: cosine for a fine-tune"
            " of a checkpoint whose preset says WarmupLR, else the preset's (docs/schedules.md)."
        ),
    )
    micro_batch: int | None = field(default=None, **_help("Override train_micro_batch_size_per_gpu."))
    grad_accum: int | None = field(default=None, **_help("Override gradient_accumulation_steps."))
    ds: list[str] = field(
        default_factory=list, **_help("Override any DeepSpeed key: --ds zero_optimization.stage=3 fp16.enabled=false")
    )
    precision: Literal["fp32", "fp16", "bf16"] | None = field(
        default=None,
        **_help(
            "Force the training precision. Default: the preset's, kept on GPUs and on CPUs with native kernels for it;"
            " fp32 on a CPU that would emulate it (see the run header and docs/precision.md)."
        ),
    )
    seed: int = field(default=0, **_help("Seed for weights init and data order."))
    log_interval: int = field(default=10, **_help("Optimizer steps between logged lines (the only host syncs)."))
    eval_interval: int = field(default=100, **_help("Optimizer steps between evaluations on the val split (0: off)."))
    eval_batches: int = field(default=8, **_help("Micro-batches per rank per evaluation."))
    save_interval: int = field(default=100, **_help("Optimizer steps between checkpoints (0: only at the end)."))
    keep_last: int = field(
        default=2, **_help("Checkpoints kept; older ones are deleted after a newer one is complete.")
    )
    max_nonfinite_steps: int = field(
        default=5,
        **_help(
            "Stop when the loss is NaN/inf this many optimizer steps in a row. fp16 gradient overflows leave the"
            " loss finite (DeepSpeed skips the update and logs it in skipped_steps), so they do not count."
        ),
    )
    resume: bool = field(default=False, **_help("Continue from the latest checkpoint in --out/checkpoints."))
    export: bool = field(
        default=True, **_help("Write Hugging Face safetensors to --out/hf at the end and verify them.")
    )
    report_to: Literal["none", "wandb", "tensorboard"] = field(default="none", **_help("Experiment tracker."))
    attn_implementation: str = field(default="sdpa", **_help("eager | sdpa | flash_attention_2"))
    experts_impl: Literal["eager", "batched_mm", "grouped_mm"] | None = field(
        default=None,
        **_help(
            "MoE experts kernel (Transformers' experts_implementation). Default: Transformers' choice, grouped_mm;"
            " see docs/performance.md for measured speeds. MoE models only."
        ),
    )
    gradient_checkpointing: bool = field(default=False, **_help("Recompute activations in backward to save memory."))
    activation_offload: bool = field(
        default=False,
        **_help("With --gradient-checkpointing: keep the checkpointed hidden states in host memory (ZeRO engines)."),
    )
    tiled_loss: Literal["on", "off"] = field(
        default="on",
        **_help(
            "on: the loss is computed over the LM head in token tiles, so the [tokens × vocab] logits are never held"
            " whole (exact; recomputes the head's logits in backward). off: the model's own loss on whole logits."
        ),
    )
    tiled_mlp: str = field(
        default="off",
        **_help(
            "Run each dense MLP in sequence tiles (DeepSpeed's TiledMLP; exact, the forward recomputed in backward):"
            " on (ceil(seq_len / hidden) tiles), a tile count, or off."
        ),
    )
    trust_remote_code: bool = field(default=False, **_help("Allow code from the model repo to run (off by default)."))
    device_map: str | None = field(
        default=None,
        **_help("'balanced': one process, layers split over the cards (naive model parallel) instead of ZeRO."),
    )
    device_map_devices: str | None = field(
        default=None, **_help("Cards for --device-map, e.g. 0,1,2 (default: all visible GPUs) or cpu,cpu,cpu.")
    )
    sequence_parallel: int | None = field(
        default=None,
        **_help(
            "Split every sequence over N ranks (all-gather attention, any head count; data-parallel size = world / N);"
            ' the same as "sequence_parallel_size": N in the DeepSpeed JSON. ZeRO engine only.'
        ),
    )
    peak_tflops: float | None = field(
        default=None, **_help("Peak dense TFLOP/s per device for MFU. Default: looked up from the GPU name.")
    )
    lora: str | None = field(
        default=None,
        **_help(
            "Train LoRA adapters only (peft), e.g. r=16,alpha=32,dropout=0.0,targets=attn[,mlp,experts|module names]."
            " The export merges them into a plain HF model."
        ),
    )
    load_in_4bit: bool | None = field(
        default=None,
        **_help(
            "With --lora: load the frozen base in 4 bits (QLoRA: bitsandbytes NF4, double quantisation, compute in"
            " the run's precision); --load-in-4bit false overrides the preset's \"quantization\" section."
        ),
    )
    packing: Literal["documents", "stream"] = field(
        default="documents",
        **_help(
            "documents: each packed document attends only to itself, its positions restarting at 0 (block-diagonal"
            " causal attention built by Transformers from position_ids); stream: the whole row is one sequence."
        ),
    )
    moe_balance: Literal["auto", "bias", "aux", "both", "off"] = field(
        default="auto",
        **_help(
            "MoE load balancing: bias (DeepSeek-V3's auxiliary-loss-free routing bias), aux (a balance loss), both,"
            " or off. auto follows the model family: V3 both (bias + sequence-wise loss), V2 aux, dense off."
        ),
    )
    moe_bias_rate: float | None = field(
        default=None, **_help("V3 bias update speed gamma per optimizer step (default 0.001; 0 freezes the bias).")
    )
    moe_aux_alpha: float | None = field(
        default=None,
        **_help("Balance-loss coefficient (default: the config's aux_loss_alpha; V3 sequence-wise 0.0001)."),
    )
    preference_loss: Literal["sigmoid", "ipo", "hinge", "simpo"] | None = field(
        default=None,
        **_help(
            "With a preference data folder (prepare --format preference): sigmoid (DPO, the default), ipo, hinge,"
            " or simpo (reference-free). Losses as TRL's DPOTrainer / CPOTrainer define them: docs/preference.md."
            ' The preset\'s "preference" section sets the same keys (loss, beta, label_smoothing, simpo_gamma,'
            " reference); the flags beat it."
        ),
    )
    beta: float | None = field(default=None, **_help("Preference loss beta (default 0.1; SimPO 2.0)."))
    label_smoothing: float | None = field(
        default=None, **_help("sigmoid/simpo: the share of pairs assumed flipped, 0 <= e < 0.5 (default 0).")
    )
    simpo_gamma: float | None = field(default=None, **_help("SimPO's target margin gamma (default 0.5)."))
    reference: Literal["precomputed", "adapters-off"] | None = field(
        default=None,
        **_help(
            "Reference log-probs: precomputed (one pass of the starting weights before training, kept in"
            " <out>/reference/, the default) or adapters-off (with --lora: the model with its adapters switched off)."
        ),
    )
    reward: list[str] = field(
        default_factory=list,
        **_help(
            "GRPO (a prompts data folder, prepare --format prompts): a reward NAME[:weight] or path/file.py:function"
            "[:weight], repeatable (docs/grpo.md)."
        ),
    )
    reward_timeout: float = field(
        default=600.0,
        **_help("GRPO: seconds a reward call may take before the run stops with one line naming it (0: no limit)."),
    )
    sandbox: Literal["bwrap", "rlimits"] = field(
        default="bwrap",
        **_help(
            "GRPO's code rewards: bwrap runs each program in bubblewrap's namespaces (no network, no files but the"
            " system's); rlimits only with resource limits, where user namespaces are off (weaker: docs/code.md)."
        ),
    )
    num_generations: int = field(default=8, **_help("GRPO: completions sampled per prompt (G, a group)."))
    max_completion_length: int | None = field(
        default=None,
        **_help(
            "GRPO: most tokens a completion may have (default: the data's, meta.json max_completion_length; else 256)."
        ),
    )
    temperature: float = field(default=1.0, **_help("GRPO: sampling temperature (the log-probs use it too)."))
    top_p: float = field(default=1.0, **_help("GRPO: nucleus sampling, in (0, 1]."))
    top_k: int = field(default=0, **_help("GRPO: sample among the k most likely tokens (0: off, TRL's default)."))
    min_p: float | None = field(default=None, **_help("GRPO: min-p sampling threshold (off by default, as TRL)."))
    repetition_penalty: float = field(default=1.0, **_help("GRPO: repetition penalty (1.0: none, TRL's default)."))
    generation_kwargs: str | None = field(
        default=None,
        **_help("GRPO: more generate arguments as a JSON object, e.g. '{\"no_repeat_ngram_size\": 3}' (TRL's)."),
    )
    epsilon: float = field(default=0.2, **_help("GRPO: lower clip of the ratio (1 - epsilon)."))
    epsilon_high: float | None = field(default=None, **_help("GRPO: upper clip (1 + epsilon_high; default epsilon)."))
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = field(
        default="dapo", **_help("GRPO: how token losses are aggregated (TRL 1.16's loss_type; default dapo).")
    )
    scale_rewards: Literal["group", "batch", "none"] = field(
        default="group", **_help("GRPO: advantages divided by the group's reward std, the batch's, or not.")
    )
    num_iterations: int = field(default=1, **_help("GRPO: optimizer steps per generation batch (mu)."))
    bias_correction_kl: bool = field(
        default=True,
        **_help("GRPO: multiply the KL term by the importance ratio (TRL 1.16's use_bias_correction_kl, its default)."),
    )
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token",
        **_help("GRPO: importance ratio per token, or per completion (GSPO; TRL's importance_sampling_level)."),
    )
    generation_batch_size: int | None = field(
        default=None,
        **_help(
            "GRPO: completion rows per generate call (default: all of a rank's rows in one call, or the largest"
            " chunk the planner fits beside training)."
        ),
    )
    generation_backend: Literal["generate", "continuous"] = field(
        default="generate",
        **_help(
            "GRPO: Transformers' generate (a rank's rows batched, each row its own random stream) or its continuous"
            " batching (generate_batch: rows leave as they finish; docs/grpo.md)."
        ),
    )
    mask_truncated_completions: bool = field(
        default=False,
        **_help("GRPO: a completion cut by --max-completion-length takes no part in the loss (TRL's flag)."),
    )
    num_generations_eval: int | None = field(
        default=None, **_help("GRPO: completions per held-out prompt at each eval (TRL's; default --num-generations).")
    )
    eval_sampling: Literal["train", "r1", "greedy"] = field(
        default="train",
        **_help(
            "GRPO's eval: train samples as training does (TRL), r1 at temperature 0.6 / top-p 0.95 (DeepSeek-R1's"
            " pass@1), greedy one completion per prompt; r1 and greedy sample exactly as evaluate.py does, without"
            " training's --top-k, --min-p, --repetition-penalty or --generation-kwargs."
        ),
    )
    local_rank: int = field(default=-1, **_help("Set by the deepspeed launcher."))

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def check(self) -> None:
        """Cheap checks that need no model or data."""
        for name in ("max_steps", "log_interval", "eval_batches", "keep_last", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}", "must be at least 1", "pass a positive integer")
        if self.device_map not in (None, "balanced"):
            raise UserError(f"--device-map {self.device_map}", "unknown placement", "use --device-map balanced")
        if not (math.isfinite(self.reward_timeout) and self.reward_timeout >= 0):
            raise UserError(
                "--reward-timeout", f"must be 0 (no limit) or more seconds, got {self.reward_timeout}", "pass e.g. 600"
            )
        for name, least in (("micro_batch", 1), ("grad_accum", 1), ("warmup_steps", 1), ("sequence_parallel", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise UserError(
                    f"--{name.replace('_', '-')}",
                    f"must be at least {least}, got {value}",
                    "pass a larger number (DeepSpeed's warm-up needs 1 step or more)"
                    if name == "warmup_steps"
                    else "pass a larger number",
                )
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise UserError("--epochs", f"must be a positive number, got {self.epochs}", "pass e.g. --epochs 3")
        if self.warmup_ratio is not None and not 0 < self.warmup_ratio < 1:
            raise UserError("--warmup-ratio", f"must be in (0, 1), got {self.warmup_ratio}", "pass e.g. 0.03")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError("--lr", f"must be a positive number, got {self.lr}", "pass e.g. --lr 3e-5")
        for name in ("eval_interval", "save_interval", "seed"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')}", "must be 0 or positive", "pass 0 or more")
        for name in ("peak_tflops", "moe_bias_rate", "moe_aux_alpha"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= (1e-9 if name == "peak_tflops" else 0)):
                raise UserError(f"--{name.replace('_', '-')}", f"must be a positive number, got {value}", "pass e.g. 1")
        for name in ("num_generations", "max_completion_length", "num_iterations", "generation_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:  # GRPO's counts
                raise UserError(
                    f"--{name.replace('_', '-')}",
                    f"must be at least 1, got {getattr(self, name)}",
                    "pass a positive integer",
                )
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise UserError(
                "--num-generations-eval", f"must be 1 or more, got {self.num_generations_eval}", "pass e.g. 4"
            )
        if self.top_k < 0:
            raise UserError("--top-k", f"must be 0 (off) or more, got {self.top_k}", "pass e.g. 50, or 0")
        if self.min_p is not None and not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise UserError("--min-p", f"must be in [0, 1], got {self.min_p}", "pass e.g. 0.1")
        generation_kwargs(self.generation_kwargs)
        numbers = (("temperature", math.inf), ("top_p", 1.0), ("epsilon", math.inf), ("epsilon_high", math.inf))
        for name, top in (*numbers, ("repetition_penalty", math.inf)):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= top):
                bound = "in (0, 1]" if top == 1.0 else "a positive number"
                raise UserError(
                    f"--{name.replace('_', '-')}",
                    f"must be {bound}, got {value}",
                    "pass e.g. 1.0" if top == 1.0 else "pass e.g. 0.2",
                )
        if self.tiled_mlp not in ("on", "off") and not (self.tiled_mlp.isdigit() and int(self.tiled_mlp) >= 1):
            raise UserError(f"--tiled-mlp {self.tiled_mlp}", "not on, off or a tile count", "pass on, off or e.g. 4")
        if self.attn_implementation not in ATTENTION and "/" not in self.attn_implementation:
            raise UserError(
                f"--attn-implementation {self.attn_implementation}",
                "unknown attention implementation",
                f"use one of {', '.join(ATTENTION)} (or a hub kernel, org/name)",
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def _flag_error(message: str) -> None:
    """argparse's error (a value of the wrong type, a missing value): one line naming the flag."""
    raise UserError("train.py", message, "see python train.py --help")


def generation_kwargs(text: str | None) -> dict[str, Any]:
    """``--generation-kwargs``: a JSON object, or one line saying what is wrong with it."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(
            "--generation-kwargs", f"not JSON ({err.msg} at character {err.pos})", _KWARGS_EXAMPLE
        ) from None
    if not isinstance(value, dict):
        raise UserError("--generation-kwargs", f"must be a JSON object, got {type(value).__name__}", _KWARGS_EXAMPLE)
    return value


_KWARGS_EXAMPLE = """pass an object, e.g. '{"no_repeat_ngram_size": 3}'"""


OVERRIDDEN_BY = {
    "epochs": "max_steps",
    "max_steps": "epochs",
    "warmup_ratio": "warmup_steps",
    "warmup_steps": "warmup_ratio",
}
"""A recipe key the command line's other flag replaces, as in Transformers' TrainingArguments (``max_steps``
overrides ``num_train_epochs``, ``warmup_steps`` overrides ``warmup_ratio``; and the reverse when the flag given is
the recipe's other one)."""


def _given(argv: list[str]) -> set[str]:
    """The flags named in ``argv`` (``--max-steps 2``, ``--max_steps=2``), as dataclass field names."""
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def recipe_argv(argv: list[str], flags: type = TrainArgs, program: str = "train.py") -> list[str]:
    """The flags a ``--config FILE`` in ``argv`` stands for (none without one), keys checked against the dataclass
    ``flags`` (train.py's :class:`TrainArgs`, evaluate.py's ``JobArgs``); an unknown key is one line. A recipe key
    whose counterpart the command line gives (:data:`OVERRIDDEN_BY`) is left out."""
    return _recipe(argv, flags, program)[0]


def _recipe(argv: list[str], flags: type, program: str) -> tuple[list[str], list[str]]:
    """:func:`recipe_argv`'s flags, and each recipe value the command line replaced (``key: value → --flag``)."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if path is None:
        return [], []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(
            f"--config {path}", f"cannot be read ({err.strerror})", "pass a recipe file (recipes/)"
        ) from None
    import yaml

    try:
        values = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise UserError(path, f"is not valid YAML/JSON ({str(err).splitlines()[0]})", "fix the file") from None
    if not isinstance(values, dict):
        raise UserError(path, "is not a mapping of flags", "write key: value lines (see recipes/)")
    known = {f.name for f in fields(flags) if f.init} - {"config"}
    given = _given(argv)
    out, replaced = [], []
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise UserError(
                path, f"unknown key '{key}'", f"did you mean '{close[0]}'?" if close else f"see python {program} --help"
            )
        if value is None:
            continue
        if (by := OVERRIDDEN_BY.get(name)) in given or name in given:
            replaced.append(f"{name}: {value} → --{(name if name in given else by).replace('_', '-')}")
            if name not in given:
                continue
        items = value if isinstance(value, list) else [value]
        out += [f"--{name}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in items)]
    return out, replaced


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """Parse the command line; unknown flags are an error, not silently ignored."""
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    recipe, replaced = _recipe(argv, TrainArgs, "train.py")
    argv = [*recipe, *argv]  # a recipe's values first: the command line's own flags come later and win
    parser = HfArgumentParser(TrainArgs, description="Train a DeepSeek-family model with DeepSpeed ZeRO.")
    parser.error = _flag_error  # argparse prints usage and its own error line, then exits: make it ours
    for action in parser._actions:  # --ds a=1 --ds b=2 keeps both (argparse's nargs="+" keeps only the last)
        if action.dest in ("ds", "reward"):
            action.__class__ = argparse._ExtendAction
        if action.dest == "load_in_4bit":  # bare --load-in-4bit means true; unset (None) defers to the preset
            action.nargs, action.const = "?", True
    (args, rest) = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        flags = [a.split("=")[0] for a in rest if a.startswith("-")] or rest
        known = [opt for action in parser._actions for opt in action.option_strings]
        close = difflib.get_close_matches(flags[0], known, n=1)
        hint = f"did you mean {close[0]}?" if close else "see python train.py --help"
        raise UserError("train.py", f"unknown argument {' '.join(rest)}", hint)
    args.replaced = replaced
    args.check()
    return args
