"""The DeepSpeed preset is checked before any model loads: batch math, "auto" values, unknown keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import NATIVE_16BIT, launch, records

from deepzero.dsconfig import BatchMath, TrainingHints, resolve
from deepzero.errors import UserError

PRESETS = sorted(Path("ds_configs").glob("*.json"))
HINTS = TrainingHints(max_steps=100, hidden_size=128)


def write(tmp_path: Path, cfg: dict | str, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


def seed_preset() -> dict:
    return json.loads(Path("ds_configs/zero2.json").read_text())


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_is_valid_for_three_ranks_and_names_its_launch_command(path: Path) -> None:
    raw = json.loads(path.read_text())
    assert (
        raw["_launch"].startswith("deepspeed --num_gpus=3 train.py --deepspeed_config") and path.name in raw["_launch"]
    )
    dp = 3 // raw.get("pipeline", {}).get("stages", 1)  # a pipeline's stages share the ranks
    cfg = resolve(path, dp_size=dp, hints=HINTS)
    assert cfg.batch.global_batch == cfg.batch.micro * cfg.batch.accum * dp == cfg.ds["train_batch_size"]
    assert "_launch" not in cfg.ds and "auto" not in json.dumps(cfg.ds)


def test_seed_preset_keeps_its_knobs() -> None:
    cfg = resolve("ds_configs/zero2.json", dp_size=3, hints=HINTS, kernels=NATIVE_16BIT).ds
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0
    zero = cfg["zero_optimization"]
    assert (zero["stage"], zero["allgather_partitions"], zero["allgather_bucket_size"], zero["reduce_scatter"]) == (
        2,
        True,
        2e8,
        True,
    )
    assert cfg["optimizer"] == {
        "type": "AdamW",
        "params": {
            "lr": 3e-5,  # "auto": the fine-tuning default
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.01,
            "torch_adam": True,
            "fused": True,
        },
    }
    assert cfg["scheduler"]["type"] == "WarmupLR" and cfg["scheduler"]["params"]["warmup_num_steps"] == 500


def test_batch_math_that_does_not_match_the_world_size_names_file_keys_and_fix(tmp_path: Path) -> None:
    path = write(tmp_path, seed_preset())
    with pytest.raises(UserError) as err:
        resolve(path, dp_size=2, hints=HINTS)
    msg = str(err.value)
    assert str(path) in msg and "train_batch_size 24" in msg and "world size 2" in msg
    assert '"train_batch_size": 16' in msg and "\n" not in msg


def test_global_batch_not_divisible_by_world_size_suggests_neighbours(tmp_path: Path) -> None:
    path = write(tmp_path, {"train_batch_size": 10, "gradient_accumulation_steps": 1})
    with pytest.raises(UserError, match=r"not divisible by world size 3.*9 or 12"):
        resolve(path, dp_size=3, hints=HINTS)


def test_auto_values_are_filled_from_the_run(tmp_path: Path) -> None:
    cfg = seed_preset() | {"train_batch_size": "auto", "gradient_clipping": "auto"}
    cfg["scheduler"]["params"] |= {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    cfg["zero_optimization"]["reduce_bucket_size"] = "auto"
    resolved = resolve(write(tmp_path, cfg), dp_size=3, hints=TrainingHints(max_steps=200, hidden_size=64, lr=1e-3))
    ds = resolved.ds
    assert ds["train_batch_size"] == 24 and ds["gradient_clipping"] == 1.0
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and ds["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 10
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_cli_micro_batch_override_recomputes_global_batch(tmp_path: Path) -> None:
    resolved = resolve(write(tmp_path, seed_preset()), dp_size=1, hints=TrainingHints(max_steps=10, micro_batch=2))
    assert resolved.batch == BatchMath(micro=2, accum=2, dp_size=1) and resolved.ds["train_batch_size"] == 4


def test_typo_in_top_level_and_zero_section_are_reported_together(tmp_path: Path) -> None:
    cfg = seed_preset()
    cfg["gradient_cliping"] = 1.0
    cfg["zero_optimization"]["allgather_bucket_sise"] = 1
    with pytest.raises(UserError) as err:
        resolve(write(tmp_path, cfg), dp_size=3, hints=HINTS)
    msg = str(err.value)
    assert "unknown key 'gradient_cliping' (did you mean 'gradient_clipping'?)" in msg
    assert "unknown key 'zero_optimization.allgather_bucket_sise' (did you mean 'allgather_bucket_size'?)" in msg


def test_unknown_scheduler_and_optimizer_params(tmp_path: Path) -> None:
    cfg = seed_preset()
    cfg["scheduler"]["params"]["warmup_steps"] = 5
    cfg["optimizer"]["params"]["weight_decy"] = 0.1
    with pytest.raises(UserError) as err:
        resolve(write(tmp_path, cfg), dp_size=3, hints=HINTS)
    assert "scheduler.params.warmup_steps" in str(err.value) and "warmup_num_steps" in str(err.value)
    assert "optimizer.params.weight_decy" in str(err.value)


def test_malformed_json_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "train_batch_size": 24,\n}\n')
    with pytest.raises(UserError, match=rf"{path}:3:1: invalid JSON"):
        resolve(path, dp_size=3, hints=HINTS)


def test_missing_file_lists_the_presets(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"zero2\.json"):
        resolve(tmp_path / "nope.json", dp_size=3, hints=HINTS)


def test_fp16_and_bf16_together_is_an_error(tmp_path: Path) -> None:
    cfg = seed_preset() | {"bf16": {"enabled": True}}
    with pytest.raises(UserError, match="pick one"):
        resolve(write(tmp_path, cfg), dp_size=3, hints=HINTS)


def test_dotted_overrides_apply_before_validation(tmp_path: Path) -> None:
    path = write(tmp_path, seed_preset())
    cfg = resolve(path, dp_size=3, hints=HINTS, overrides=["zero_optimization.stage=3", "fp16.enabled=false"]).ds
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["fp16"]["enabled"] is False


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "fast"])
def test_a_learning_rate_that_is_not_a_positive_number_is_named(tmp_path: Path, bad: object) -> None:
    cfg = seed_preset()
    cfg["optimizer"]["params"]["lr"] = bad
    with pytest.raises(UserError, match=r"'optimizer\.params\.lr' must be a positive number"):
        resolve(write(tmp_path, cfg), dp_size=3, hints=HINTS)


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"torch_adam": False, "fused": True}, "'optimizer.params.fused' needs \"torch_adam\": true"),
        (
            {"torch_adam": True, "bias_correction": True},
            "'optimizer.params.bias_correction' needs \"torch_adam\": false",
        ),
        ({"torch_adam": True, "fused": True, "foreach": True}, "are both true (pick one)"),
    ],
)
def test_adam_keys_must_suit_the_adam_deepspeed_builds(tmp_path: Path, params: dict, problem: str) -> None:
    """DeepSpeed passes these keys on to torch's AdamW (torch_adam) or to its own Adam, which raise a TypeError."""
    cfg = seed_preset()
    cfg["optimizer"]["params"] |= params
    with pytest.raises(UserError) as err:
        resolve(write(tmp_path, cfg), dp_size=3, hints=HINTS)
    assert problem in str(err.value)


@pytest.mark.parametrize(("name", "kind"), [("cosine", "WarmupCosineLR"), ("linear", "WarmupDecayLR")])
def test_lr_schedule_switch_decays_to_max_steps(name: str, kind: str) -> None:
    hints = TrainingHints(max_steps=100, hidden_size=128, lr=1e-4, warmup_steps=10, lr_schedule=name)
    sched = resolve("ds_configs/zero2.json", dp_size=3, hints=hints).ds["scheduler"]
    assert sched["type"] == kind and sched["params"]["total_num_steps"] == 100
    assert sched["params"]["warmup_num_steps"] == 10 and sched["params"]["warmup_type"] == "linear"
    assert sched["params"].get("warmup_max_lr", 1e-4) == 1e-4  # cosine scales the optimizer's lr


def test_a_warmup_as_long_as_the_run_leaves_nothing_to_decay() -> None:
    hints = TrainingHints(max_steps=100, hidden_size=128, lr_schedule="cosine")  # the preset warms up for 500 steps
    with pytest.raises(UserError, match=r"'scheduler\.params\.warmup_num_steps' 500 leaves no steps to decay over"):
        resolve("ds_configs/zero2.json", dp_size=3, hints=hints)


def test_resolving_inside_a_process_group_checks_the_batch_for_its_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that resolves after ``init_distributed`` (bench/bare_loop.py) gets the same config as one before it:
    DeepSpeed's own parser then divides by the whole world, and its batch keys must be set for that."""
    from deepspeed import comm

    before = resolve("ds_configs/zero2.json", 3, TrainingHints(max_steps=10), kernels=NATIVE_16BIT)
    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: 3)
    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    inside = resolve("ds_configs/zero2.json", 3, TrainingHints(max_steps=10), kernels=NATIVE_16BIT)
    assert inside.batch == before.batch == BatchMath(4, 2, 3)
    assert inside.ds == before.ds


# ------------------------------------------------------------------------------------ the lr that trains


def edited(tmp_path: Path, preset: Path, **params: object) -> Path:
    """A copy of ``preset`` with only ``optimizer.params`` keys changed (what a user does to change the lr)."""
    cfg = json.loads(preset.read_text())
    cfg["optimizer"]["params"] |= params
    return write(tmp_path, cfg, f"my_{preset.name}")


def peaks(cfg: dict) -> tuple[float, float | None]:
    return cfg["optimizer"]["params"]["lr"], cfg["scheduler"]["params"].get("warmup_max_lr")


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_an_lr_edited_in_a_copy_of_a_preset_is_the_peak(tmp_path: Path, path: Path) -> None:
    """The schedule's peak follows the optimizer's lr; before, WarmupLR's own 3e-5 overwrote it while run_config.json
    showed the edit. The random-init preset's default (``default_lr``) does not beat a number the user wrote."""
    dp = 3 // json.loads(path.read_text()).get("pipeline", {}).get("stages", 1)
    hints = TrainingHints(max_steps=100, hidden_size=64, default_lr=2e-3, default_lr_source="model preset tiny")
    mine = edited(tmp_path, path, lr=1e-3)
    cfg = resolve(mine, dp, hints, kernels=NATIVE_16BIT)
    assert peaks(cfg.ds) == (1e-3, 1e-3) and cfg.lr_source == f"{mine} optimizer.params.lr"
    shipped = resolve(path, dp, hints, kernels=NATIVE_16BIT)  # "auto": the model preset's default
    assert peaks(shipped.ds) == (2e-3, 2e-3) and shipped.lr_source.startswith("model preset tiny")
    finetune = resolve(path, dp, TrainingHints(max_steps=100, hidden_size=64), kernels=NATIVE_16BIT)
    assert peaks(finetune.ds) == (3e-5, 3e-5) and "fine-tuning default" in finetune.lr_source


def test_a_ds_override_of_the_lr_is_the_peak_and_named_as_its_source() -> None:
    hints = TrainingHints(max_steps=100, default_lr=2e-3)
    cfg = resolve("ds_configs/zero2.json", 3, hints, ["optimizer.params.lr=5e-4"], kernels=NATIVE_16BIT)
    assert peaks(cfg.ds) == (5e-4, 5e-4) and cfg.lr_source == "--ds optimizer.params.lr"
    cfg = resolve("ds_configs/zero2.json", 3, hints, ["scheduler.params.warmup_max_lr=7e-4"], kernels=NATIVE_16BIT)
    assert peaks(cfg.ds) == (7e-4, 7e-4) and cfg.lr_source == "--ds scheduler.params.warmup_max_lr"


def test_an_explicit_peak_that_disagrees_with_an_explicit_lr_is_one_line(tmp_path: Path) -> None:
    cfg = seed_preset()
    cfg["optimizer"]["params"]["lr"] = 1e-3
    cfg["scheduler"]["params"]["warmup_max_lr"] = 3e-5  # an older copy of the preset
    path = write(tmp_path, cfg)
    with pytest.raises(UserError) as err:
        resolve(path, 3, HINTS)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert "'optimizer.params.lr' 0.001" in msg and "'scheduler.params.warmup_max_lr' 3e-05" in msg
    assert '"scheduler.params.warmup_max_lr": "auto"' in msg
    cfg["scheduler"]["params"]["warmup_max_lr"] = 1e-3  # agreeing numbers are fine
    assert peaks(resolve(write(tmp_path, cfg), 3, HINTS, kernels=NATIVE_16BIT).ds) == (1e-3, 1e-3)


def test_cli_lr_beats_both_keys_and_a_schedule_switch_keeps_the_edited_lr(tmp_path: Path) -> None:
    path = edited(tmp_path, Path("ds_configs/zero2.json"), lr=1e-3)
    cli = resolve(path, 3, TrainingHints(max_steps=100, lr=4e-4), ["scheduler.params.warmup_max_lr=9e-4"])
    assert peaks(cli.ds) == (4e-4, 4e-4) and cli.lr_source == "--lr"
    for name in ("constant", "cosine", "linear"):
        hints = TrainingHints(max_steps=100, warmup_steps=10, lr_schedule=name, default_lr=2e-3)
        ds = resolve(path, 3, hints, kernels=NATIVE_16BIT).ds
        assert peaks(ds)[0] == 1e-3 and peaks(ds)[1] in (None, 1e-3), name


@pytest.mark.launcher
def test_train_py_trains_at_the_lr_edited_in_a_copy_of_a_preset(tiny_data: Path, tmp_path: Path) -> None:
    """tiny-deepseek-v3 is a random-init preset (pretraining lr 2e-3 for "auto"): the copy's 1e-3 must train."""
    mine = edited(tmp_path, Path("ds_configs/zero2.json"), lr=1e-3)
    out = tmp_path / "run"
    args = ["--deepspeed_config", str(mine), "--model", "tiny-deepseek-v3", "--data", str(tiny_data), "--out", str(out)]
    args += ["--precision", "fp32", "--max-steps", "4", "--warmup-steps", "2", "--micro-batch", "1"]
    args += ["--grad-accum", "1", "--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export"]
    proc = launch(args, nproc=1)
    lrs = [r["lr"] for r in records(out)]  # linear warm-up over 2 steps from 0, then the peak
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3], rel=1e-9)
    assert f"lr: peak 0.001 from {mine} optimizer.params.lr" in proc.stdout
    run_config = json.loads((out / "run_config.json").read_text())
    assert peaks(run_config["deepspeed"]) == (1e-3, 1e-3)
    assert run_config["lr_source"] == f"{mine} optimizer.params.lr"


def test_plan_run_takes_the_random_init_presets_lr_only_where_the_json_says_auto(
    tiny_data: Path, tmp_path: Path
) -> None:
    """train.py's planning step: tiny-deepseek-v3 (pretraining lr 2e-3) with the shipped zero2.json ("auto"), with
    ``--ds optimizer.params.lr=5e-4``, and with --lr on top of a conflicting --ds peak."""
    from deepzero.args import parse_args
    from deepzero.run import plan_run

    base = ["--model", "tiny-deepseek-v3", "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--no-export"]

    def plan(*extra: str) -> tuple[tuple[float, float | None], str]:
        p = plan_run(parse_args([*base, "--precision", "fp32", *extra]), 3)
        return peaks(p.cfg.ds), p.lr_source

    shipped, source = plan()
    assert shipped == (2e-3, 2e-3) and source.startswith("model preset tiny-deepseek-v3, random init")
    assert plan("--ds", "optimizer.params.lr=5e-4") == ((5e-4, 5e-4), "--ds optimizer.params.lr")
    with pytest.raises(UserError, match=r"'optimizer\.params\.lr' 0\.0005 \(--ds\) and 'scheduler\.params\.warmup"):
        plan("--ds", "optimizer.params.lr=5e-4", "scheduler.params.warmup_max_lr=1e-3")
    assert plan("--lr", "4e-4", "--ds", "scheduler.params.warmup_max_lr=1e-3") == ((4e-4, 4e-4), "--lr")


def test_fp32_accumulation_of_16_bit_gradients_without_zero_is_one_line() -> None:
    """DeepSpeed refuses bf16 weights with fp32 gradient accumulation at stage 0 (NotImplementedError on every
    rank); the presets accumulate in fp32, so a user who turns ZeRO off gets the line instead."""
    with pytest.raises(UserError, match=r"'data_types\.grad_accum_dtype' 'fp32' with bf16 needs 'zero_optimization"):
        resolve("ds_configs/zero2_bf16.json", 3, HINTS, ["zero_optimization.stage=0"], kernels=NATIVE_16BIT)
    resolve("ds_configs/zero2_bf16.json", 3, HINTS, ["zero_optimization.stage=1"], kernels=NATIVE_16BIT)
    with pytest.raises(UserError, match=r"'data_types\.grad_accum_dtype' 'fp32' with bf16 needs 'zero_optimization"):
        resolve("ds_configs/pipeline.json", 1, HINTS, ["zero_optimization.stage=0"], kernels=NATIVE_16BIT)


def test_the_pipeline_with_bf16_and_fp32_accumulation_needs_immediate_grad_updates() -> None:
    """Without bf16.immediate_grad_update, DeepSpeed 0.19.8's BF16_Optimizer under the pipeline schedule loses part of
    each step's gradient (tests/test_pipeline.py::test_loss_falls fails: 6.27 -> 6.06 instead of 5.40): one line
    naming the key; the shipped pipeline preset sets it, and bf16 accumulation needs nothing."""
    with pytest.raises(UserError, match=r"'bf16\.immediate_grad_update' must be true with the \"pipeline\" section"):
        resolve("ds_configs/pipeline.json", 1, HINTS, ["bf16.immediate_grad_update=false"], kernels=NATIVE_16BIT)
    resolve("ds_configs/pipeline.json", 1, HINTS, [], kernels=NATIVE_16BIT)
    over = ["bf16.immediate_grad_update=false", "data_types.grad_accum_dtype=bf16"]
    resolve("ds_configs/pipeline.json", 1, HINTS, over, kernels=NATIVE_16BIT)
