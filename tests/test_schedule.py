"""Schedules that reach their peak: --epochs gives the steps from the data and the batch, --warmup-ratio the
warm-up, a warm-up as long as the run is one warning line, and a LoRA run's "auto" lr is LoRA's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deepzero.args import parse_args
from deepzero.errors import UserError
from deepzero.presets import get_preset
from deepzero.run import plan_run

BASE = ["--deepspeed_config", "ds_configs/zero2.json", "--micro-batch", "2", "--grad-accum", "1"]


def planned(tiny_data: Path, tmp_path: Path, *extra: str):
    return plan_run(parse_args([*BASE, "--data", str(tiny_data), "--out", str(tmp_path / "run"), *extra]), 3)


def scheduler(plan) -> dict:
    return plan.cfg.ds["scheduler"]["params"]


def test_epochs_give_the_steps_and_the_ratio_the_warm_up(tiny_data: Path, tmp_path: Path) -> None:
    rows = json.loads((tiny_data / "meta.json").read_text())["n_rows"]["train"]
    plan = planned(tiny_data, tmp_path, "--epochs", "2", "--warmup-ratio", "0.1", "--lr-schedule", "cosine")
    steps = math.ceil(2 * rows / 6)  # global batch: 2 a rank x 3 ranks
    assert scheduler(plan)["total_num_steps"] == steps and scheduler(plan)["warmup_num_steps"] == math.ceil(0.1 * steps)


def test_a_warm_up_longer_than_the_run_is_one_warning(tiny_data: Path, tmp_path: Path, capsys) -> None:
    base = tmp_path / "base"
    get_preset("tiny-deepseek-v3").config().save_pretrained(base)  # a checkpoint: the preset's 500-step warm-up
    planned(tiny_data, tmp_path, "--model", str(base), "--max-steps", "200", "--allow-tokenizer-change")
    lines = [x for x in capsys.readouterr().err.splitlines() if "never reaches its peak" in x]
    assert (
        len(lines) == 1 and "(500 steps)" in lines[0] and "40% of its peak" in lines[0] and "--warmup-ratio" in lines[0]
    )
    planned(tiny_data, tmp_path, "--model", str(base), "--max-steps", "200", "--warmup-ratio", "0.03",
            "--allow-tokenizer-change")  # fmt: skip
    assert "never reaches its peak" not in capsys.readouterr().err


def test_lora_s_auto_lr_is_lora_s(tiny_data: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    get_preset("tiny-deepseek-v3").config().save_pretrained(base)
    common = ["--model", str(base), "--allow-tokenizer-change", "--warmup-ratio", "0.03"]
    full = planned(tiny_data, tmp_path, *common)
    lora = planned(tiny_data, tmp_path, *common, "--lora", "r=8,alpha=16,targets=attn")
    assert full.cfg.ds["optimizer"]["params"]["lr"] == 3e-5
    assert lora.cfg.ds["optimizer"]["params"]["lr"] == 2e-4 and "LoRA" in lora.lr_source


def test_a_fine_tune_decays_by_cosine_unless_told_and_a_random_init_preset_keeps_its_schedule(
    tiny_data: Path, tmp_path: Path
) -> None:
    """The shipped presets' WarmupLR never decays: a fine-tune of a checkpoint gets cosine to 0.1 x the peak at its
    last step (the header's lr line says why); --lr-schedule constant keeps WarmupLR; a random-init preset keeps it."""
    base = tmp_path / "base"
    get_preset("tiny-deepseek-v3").config().save_pretrained(base)
    common = ["--model", str(base), "--allow-tokenizer-change", "--max-steps", "40", "--warmup-ratio", "0.1"]
    tune = planned(tiny_data, tmp_path, *common)
    assert tune.cfg.ds["scheduler"]["type"] == "WarmupCosineLR"
    assert scheduler(tune)["total_num_steps"] == 40 and scheduler(tune)["cos_min_ratio"] == 0.1
    assert "cosine decay, the fine-tuning default (--lr-schedule constant keeps" in tune.cfg.lr_source
    kept = planned(tiny_data, tmp_path, *common, "--lr-schedule", "constant")
    assert kept.cfg.ds["scheduler"]["type"] == "WarmupLR" and "cosine" not in kept.cfg.lr_source
    linear = planned(tiny_data, tmp_path, *common, "--ds", "scheduler.type=WarmupDecayLR",
                     "--ds", "scheduler.params.total_num_steps=auto")  # fmt: skip
    assert linear.cfg.ds["scheduler"]["type"] == "WarmupDecayLR"  # a decay the preset asks for is kept
    scratch = planned(tiny_data, tmp_path, "--max-steps", "40")
    assert scratch.cfg.ds["scheduler"]["type"] == "WarmupLR"
    # A run that trained with WarmupLR (before this default, or told) keeps it on --resume without --lr-schedule.
    from deepzero.schedule import kept_on_resume

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "run_config.json").write_text(json.dumps({"deepspeed": kept.cfg.ds}))
    argv = [*BASE, "--data", str(tiny_data), "--out", str(run), *common]
    assert kept_on_resume(parse_args([*argv, "--resume"]))
    assert not kept_on_resume(parse_args(argv)) and not kept_on_resume(
        parse_args([*argv, "--resume", "--lr-schedule", "cosine"])
    )
    (run / "run_config.json").write_text(json.dumps({"deepspeed": tune.cfg.ds}))
    assert not kept_on_resume(parse_args([*argv, "--resume"]))  # it decayed: it goes on decaying


@pytest.mark.parametrize(
    "extra, key",
    [(["--epochs", "0"], "--epochs"), (["--warmup-ratio", "1.5"], "--warmup-ratio"),
     (["--warmup-ratio", "0.1", "--warmup-steps", "5"], "--warmup-ratio")],
)  # fmt: skip
def test_bad_schedule_flags_are_one_line(tiny_data: Path, tmp_path: Path, extra: list[str], key: str) -> None:
    with pytest.raises(UserError, match=key):
        planned(tiny_data, tmp_path, *extra)
