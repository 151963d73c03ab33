"""GRPO's phases of a run's setup (see ``deepzero.methods``): its settings from the flags and the rewards, the
engine it runs on (the ZeRO engine, whole rows per rank), the batch it needs, the planner's rows per generate call
on a card, and what its objective gets once the engine exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from deepzero.args import TrainArgs, generation_kwargs
from deepzero.dsconfig import BatchMath
from deepzero.errors import UserError, warn
from deepzero.losses.grpo.settings import GRPOSettings

GRPO_LR = 1e-6
"""What ``"lr": "auto"`` trains GRPO at: TRL 1.16's ``GRPOConfig.learning_rate`` (the fine-tuning default, 3e-5,
is thirty times that)."""


def completion_limit(args: TrainArgs, meta: dict[str, Any]) -> int:
    """``--max-completion-length``, else the data's (meta.json, what data/prepare.py budgeted), else 256 (TRL's
    default is 512); a flag that differs from the data's is said in one warning line (soft_overlong keeps the
    data's)."""
    data = meta.get("max_completion_length")
    if args.max_completion_length is None:
        return int(data or 256)
    if data and int(data) != args.max_completion_length:
        warn(
            f"--max-completion-length {args.max_completion_length} differs from the data's"
            f" {data} ({args.data}/meta.json); --reward soft_overlong keeps the data's. Fix: drop the flag to"
            " use the data's, or prepare the data with that --max-completion-length"
        )
    return args.max_completion_length


def plan(args: TrainArgs, meta: dict[str, Any], config: Any) -> tuple[GRPOSettings | None, Any]:
    """GRPO's settings and rewards for a prompts data folder (None, None for any other data; --reward there is
    refused). Every value is checked and the rewards imported here, before any weight is loaded."""
    if meta["format"] != "prompts":
        if args.reward:
            raise UserError(
                "--reward",
                f"{args.data} holds {meta['format']} data, not prompts",
                "prepare prompts with data/prepare.py --format prompts, or drop --reward",
            )
        return None, None
    lora = args.lora is not None
    beta = 0.0 if args.beta is None else args.beta
    settings = GRPOSettings(
        rewards=tuple(args.reward),
        num_generations=args.num_generations,
        max_completion_length=completion_limit(args, meta),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        generation_kwargs=generation_kwargs(args.generation_kwargs),
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        loss_type=args.loss_type,
        beta=beta,
        scale_rewards=args.scale_rewards,
        num_iterations=args.num_iterations,
        mask_truncated_completions=args.mask_truncated_completions,
        bias_correction_kl=args.bias_correction_kl,
        importance_sampling_level=args.importance_sampling_level,
        generation_batch_size=args.generation_batch_size,
        generation_backend=args.generation_backend,
        num_generations_eval=args.num_generations_eval,
        eval_sampling=args.eval_sampling,
        reference=("adapters-off" if lora else "frozen-copy") if beta else "none",
    )
    settings.check()
    if settings.importance_sampling_level == "sequence" and settings.loss_type != "grpo":
        warn(
            f"--importance-sampling-level sequence with --loss-type {settings.loss_type} sums per-token terms,"
            " weighting each completion by its length (TRL says so too). Fix: --loss-type grpo for GSPO's own"
            " per-sequence objective"
        )
    longest = int(meta.get("max_prompt_len", 0)) + settings.max_completion_length
    if longest > config.max_position_embeddings:
        raise UserError(
            "--max-completion-length",
            f"the longest prompt ({meta.get('max_prompt_len')}) + {settings.max_completion_length} completion tokens"
            f" exceed the model's max_position_embeddings {config.max_position_embeddings}",
            "pass a smaller --max-completion-length",
        )
    from deepzero.rollout.rewards import parse_rewards

    length = int(meta.get("max_completion_length") or settings.max_completion_length)
    rewards = parse_rewards(list(args.reward), length, sandbox=args.sandbox, timeout_s=args.reward_timeout)
    rewards.check_fields(meta.get("record_fields", []), args.data)
    return settings, rewards


def engine(settings: Any, grpo: GRPOSettings | None, seed: int) -> Any:
    """The engine settings with GRPO in them: the ZeRO engine, whole rows per rank; others refused in one line."""
    if grpo is None:
        return settings
    from deepzero.engines import ZeroSettings

    if not isinstance(settings, ZeroSettings):
        raise UserError(
            "--data (prompts)",
            "GRPO runs on the ZeRO engine only, not with a pipeline or --device-map",
            "use a ZeRO preset (ds_configs/zero2.json or zero3.json) without --device-map",
        )
    if settings.sequence_parallel > 1:
        raise UserError(
            f"sequence_parallel_size {settings.sequence_parallel}",
            "GRPO generates and scores whole completions on one rank",
            "drop --sequence-parallel / sequence_parallel_size for a prompts data folder",
        )
    return dataclasses.replace(settings, grpo=grpo, seed=seed)


def check_batch(grpo: GRPOSettings | None, batch: BatchMath) -> None:
    """A rank's completions per step (micro × accumulation) hold whole groups: each group on one rank."""
    if grpo is None:
        return
    per_rank = batch.micro * batch.accum
    if per_rank % grpo.num_generations:
        raise UserError(
            f"--num-generations {grpo.num_generations}",
            f"a rank's {per_rank} completions per step (micro {batch.micro} × accumulation {batch.accum}) do not"
            " hold whole groups (each prompt's completions are generated and scored on one rank)",
            f"pass --micro-batch × --grad-accum a multiple of {grpo.num_generations}",
        )


def plan_generation_batch(
    grpo: GRPOSettings | None, args: TrainArgs, meta: dict[str, Any], config: Any, settings: Any, cfg: Any, **fit: Any
) -> None:
    """Without ``--generation-batch-size``: the planner's rows per ``generate`` call on the detected cards, when
    fewer than all of a rank's rows fit beside training (``plan.generation_batch``; none on the CPU)."""
    if grpo is None or grpo.generation_batch_size is not None:
        return
    from deepzero.plan import GrpoTerms, generation_batch

    terms = GrpoTerms(grpo.num_generations, int(meta.get("max_prompt_len", 0)) or 1, grpo.reference == "frozen-copy")
    most = cfg.batch.micro * cfg.batch.accum
    rows = generation_batch(config, settings, cfg, terms, grpo.max_completion_length, most=most, **fit)
    if rows is not None and rows < most:
        grpo.generation_batch_size = rows


def attach(engine: Any, plan: Any, out_dir: Path) -> None:
    """Give the GRPO objective its prompts (train and held-out), tokenizer, rewards and run folder; a ZeRO-3 full
    fine-tuning run with beta > 0 (a frozen copy of partitioned weights) is refused."""
    objective = engine.objective
    if objective.settings.reference == "frozen-copy" and getattr(engine, "partitioned_at_load", False):
        raise UserError(
            "--beta",
            "a frozen reference copy of ZeRO-3's partitioned weights is not supported",
            "add --lora (the reference is the model with its adapters off), or train with ZeRO-2",
        )
    objective.attach(plan.train_data, plan.tokenizer, plan.rewards, out_dir, engine.model)
    objective.data_eval = plan.val_data
