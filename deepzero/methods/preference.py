"""Preference tuning's phases of a run's setup (see ``deepzero.methods``): its settings from the flags, the preset's
"preference" section and the data; the engine it runs on (ZeRO, whole pairs per rank); its reference once the
engine exists (precomputed log-probs, or the adapters off)."""

from __future__ import annotations

import dataclasses
from typing import Any

from deepzero import dsconfig, reference
from deepzero.args import TrainArgs
from deepzero.data import PreferenceDataset
from deepzero.engines import EngineSettings, TrainEngine
from deepzero.errors import UserError
from deepzero.losses.objectives import PREFERENCE_KEYS, PREFERENCE_SECTION, PreferenceSettings, choose_preference


def plan(args: TrainArgs, meta: dict[str, Any]) -> PreferenceSettings | None:
    """The preference loss for a preference data folder: sigmoid DPO unless a flag or the preset's "preference"
    section (after ``--ds`` overrides) picks another, flags first. Either one on other data is an error."""
    flags = {
        "loss": args.preference_loss,
        "beta": args.beta,
        "label_smoothing": args.label_smoothing,
        "simpo_gamma": args.simpo_gamma,
        "reference": args.reference,
    }
    section = dsconfig.owned_section(args.deepspeed_config, args.ds, PREFERENCE_SECTION)
    given = [PREFERENCE_KEYS[k] for k, v in flags.items() if v is not None]
    given += [f"{args.deepspeed_config}: {PREFERENCE_SECTION}"] * (section is not None)
    if meta["format"] == "prompts":  # GRPO's KL coefficient is --beta too
        given = [flag for flag in given if flag != "--beta"]
    if meta["format"] != "preference":
        if given:
            raise UserError(
                given[0],
                f"{args.data} holds {meta['format']} data, not preference pairs",
                "prepare pairs with data/prepare.py --format preference, or drop it",
            )
        return None
    return choose_preference(flags, section, args.deepspeed_config)


def engine(settings: EngineSettings, preference: PreferenceSettings | None, source: str) -> EngineSettings:
    """The engine settings with the preference loss in them: the ZeRO engine, each pair's rows on one rank; the
    adapters-off reference needs LoRA adapters. ``source``: the DeepSpeed JSON (named in errors)."""
    if preference is None:
        return settings
    from deepzero.engines import PipelineSettings, ZeroSettings

    if not isinstance(settings, ZeroSettings):
        way = f'the "pipeline" section of {source}' if isinstance(settings, PipelineSettings) else "--device-map"
        raise UserError(
            "--data (preference pairs)",
            f"preference training runs on the ZeRO engine only, not with {way}",
            "use a ZeRO preset (ds_configs/zero2.json or zero3.json) without --device-map",
        )
    if settings.sequence_parallel > 1:
        raise UserError(
            f"sequence_parallel_size {settings.sequence_parallel}",
            "preference training needs each pair's whole rows on one rank",
            "drop --sequence-parallel / sequence_parallel_size for a preference data folder",
        )
    if preference.reference == "adapters-off" and settings.lora is None:
        raise UserError(
            "--reference adapters-off",
            "switching adapters off gives the reference only when LoRA adapters train",
            "add --lora, or use --reference precomputed (the default)",
        )
    return dataclasses.replace(settings, preference=preference)


def attach(args: TrainArgs, plan: Any, engine: TrainEngine) -> str | None:
    """A preference run's reference: precomputed log-probs loaded, or computed now (see ``deepzero.reference``);
    with the adapters off, the starting routing biases kept for it. The header's line; None for any other run."""
    if plan.preference is None or plan.preference.reference == "none":
        return None
    if plan.preference.reference == "adapters-off":
        engine.objective.remember_start(engine.model)
        return "reference: the model with its LoRA adapters off and its starting routing biases (no second model)"
    splits = {"train": plan.train_data} | ({"val": plan.val_data} if plan.val_data is not None else {})
    assert all(isinstance(data, PreferenceDataset) for data in splits.values())
    expected = reference.stamp(args.model, plan.source.random_init, args.seed, plan.cfg.precision, args.data)
    return reference.attach(engine, splits, args.out_dir, expected)
