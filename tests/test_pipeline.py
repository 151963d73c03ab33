"""Pipeline parallelism: stages equal the HF model in one process; with 3 real ranks the pipelined loss equals the
plain model's, falls, resumes bit-exactly, and exports a Hugging Face folder that reloads with the same logits."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, cpu_env, launch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from deepzero import dsconfig
from deepzero.data import PackedDataset
from deepzero.errors import UserError
from deepzero.pipeline import (
    PipelineSettings,
    build_name_map,
    causal_lm_loss,
    pipeline_batches,
    sequential_forward,
    to_pipeline_layers,
)
from deepzero.presets import get_preset

STEPS = 12
HALF = STEPS // 2


def tiny_models() -> dict[str, Any]:
    """Configs of every decoder family the stages claim to handle, at test size."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=128)
    return {
        "deepseek_v3": get_preset("tiny-deepseek-v3").config(vocab_size=128),
        "deepseek_v2": get_preset("tiny-deepseek-v2").config(vocab_size=128),
        "llama": LlamaConfig(**small, num_key_value_heads=2, tie_word_embeddings=False),
        "qwen2_sliding": Qwen2Config(
            **small,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
    }


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(tiny_models()))
def test_stages_run_in_sequence_equal_the_hf_model(family: str, attn: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_models()[family], dtype=torch.float32, attn_implementation=attn)
    model.eval()
    ids = torch.randint(0, 128, (2, 16))
    labels = torch.randint(0, 128, (2, 16))
    labels[0, :4] = -100
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels, shift_labels=labels)
        layers = to_pipeline_layers(model)
        logits = sequential_forward(layers, ids)
    assert torch.equal(logits, ref.logits)
    assert causal_lm_loss(logits, labels).item() == ref.loss.item()
    name_map = build_name_map(model, layers)
    assert sorted(name_map.values()) == sorted(model.state_dict())
    assert name_map["0.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert name_map["1.layer.input_layernorm.weight"] == "model.layers.0.input_layernorm.weight"
    assert layers[1].layer is model.model.layers[0]  # the HF modules themselves, not copies


def test_pipeline_batches_feed_inputs_and_shifted_labels(tiny_data: Path) -> None:
    row = PackedDataset(tiny_data, "val")[0]
    batch = {k: v.unsqueeze(0) for k, v in row.items()}
    ((inputs, labels),) = list(pipeline_batches([batch]))
    assert torch.equal(inputs, batch["input_ids"]) and torch.equal(labels, batch["labels"])
    assert torch.equal(inputs[0, 1:], labels[0, :-1])


def test_preset_resolves_with_the_pipeline_data_parallel_size() -> None:
    raw = dsconfig.load_json("ds_configs/pipeline.json")
    assert raw["_launch"] == "deepspeed --num_gpus=3 train.py --deepspeed_config ds_configs/pipeline.json"
    settings = PipelineSettings.from_ds(raw)
    assert settings == PipelineSettings(3, "parameters", 0)
    dp = settings.dp_size(3)
    cfg = dsconfig.resolve("ds_configs/pipeline.json", dp_size=dp, hints=dsconfig.TrainingHints(max_steps=10))
    assert (cfg.batch.micro, cfg.batch.accum, cfg.batch.dp_size, cfg.batch.global_batch) == (2, 6, 1, 12)
    assert cfg.is_pipeline and cfg.precision == "bf16" and cfg.zero_stage == 1
    settings.check_accum(cfg.batch.accum)
    with pytest.raises(UserError, match="world size 3"):  # the whole world is not data-parallel under a pipeline
        dsconfig.resolve("ds_configs/pipeline.json", dp_size=3, hints=dsconfig.TrainingHints(max_steps=10))


def test_bad_pipeline_settings_are_one_clear_error() -> None:
    with pytest.raises(UserError, match='no "pipeline" section'):
        PipelineSettings.from_ds({})
    bad = {"pipeline": {"stages": 0, "partition": "best"}, "zero_optimization": {"stage": 2}}
    with pytest.raises(UserError) as err:
        PipelineSettings.from_ds(bad, "x.json")
    assert all(s in str(err.value) for s in ("pipeline.stages", "pipeline.partition", "ZeRO stage 2"))
    with pytest.raises(UserError, match="do not divide the world size 4"):
        PipelineSettings(3).dp_size(4)
    with pytest.raises(UserError, match="cannot fill a 3-stage pipeline"):
        PipelineSettings(3).check_accum(2)


def test_tied_embeddings_are_refused() -> None:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.vocab_size, config.tie_word_embeddings = 64, True
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match="tied input/output embeddings"):
        to_pipeline_layers(model)


# ---- three real ranks (deepspeed launcher, CPU accelerator, gloo) ----------------------------------------------


def drive(data: Path, out: Path, *args: str) -> dict[str, Any]:
    """`deepspeed --num_gpus=3 tests/helpers/pipeline_driver.py ...`; returns its report.json."""
    argv = ["--data", str(data), "--out", str(out), "--max-steps", str(STEPS), *args]
    env = cpu_env(PYTHONPATH=str(REPO))
    launch(argv, env=env, timeout=600, script="tests/helpers/pipeline_driver.py")
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def whole(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """ds_configs/pipeline.json (bf16, 3 stages, micro 2 × 6 micro-batches) for STEPS steps, with export."""
    out = tmp_path_factory.mktemp("pipe") / "whole"
    return out, drive(tiny_data, out, "--steps", str(STEPS))


@pytest.mark.launcher
def test_fp32_pipeline_loss_equals_the_plain_model(tiny_data: Path, tmp_path: Path) -> None:
    report = drive(tiny_data, tmp_path / "fp32", "--steps", "1", "--ds", "bf16.enabled=false")
    assert report["precision"] == "fp32"
    ref = report["reference_loss"]["fp32"]
    assert report["pipeline_loss"] == pytest.approx(ref, rel=1e-5, abs=1e-5)
    assert report["export"]["dtype"] == "float32" and report["export"]["max_abs_logit_diff"] <= 1e-5


@pytest.mark.launcher
def test_bf16_pipeline_loss_equals_the_plain_model(whole: tuple[Path, dict[str, Any]]) -> None:
    _, report = whole
    assert report["precision"] == "bf16" and report["batch"] == {"micro": 2, "accum": 6, "dp_size": 1}
    parts = report["parts"]
    assert parts[0] == 0 and parts[-1] == 6 and len(parts) == 4 and all(a < b for a, b in itertools.pairwise(parts))
    ref = report["reference_loss"]
    assert report["pipeline_loss"] == pytest.approx(ref["engine_dtype"], rel=2e-2)
    assert report["pipeline_loss"] == pytest.approx(ref["fp32"], rel=2e-2)


@pytest.mark.launcher
def test_loss_falls(whole: tuple[Path, dict[str, Any]]) -> None:
    _, report = whole
    curve = {int(k): v for k, v in report["losses"].items()}
    assert sorted(curve) == list(range(1, STEPS + 1)) and report["global_steps"] == STEPS
    first, last = curve[1], sum(curve[s] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert first > 6.0 and last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert report["pipeline_loss_after"] < report["pipeline_loss"] - 0.5
    assert report["grad_norm"] > 0


@pytest.mark.launcher
def test_resume_continues_the_uninterrupted_run_exactly(
    whole: tuple[Path, dict[str, Any]], tiny_data: Path, tmp_path: Path
) -> None:
    _, full = whole
    out = tmp_path / "split"
    first = drive(tiny_data, out, "--steps", str(HALF), "--no-export")
    ckpt = out / "checkpoints" / f"step{HALF:08d}"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    assert sorted(p.name for p in ckpt.glob("layer_*-model_states.pt")) == [
        f"layer_{i:02d}-model_states.pt" for i in range(6)
    ]
    second = drive(tiny_data, out, "--steps", str(HALF), "--resume", "--no-export")
    assert (first["end_step"], second["start_step"], second["end_step"], second["global_steps"]) == (6, 6, 12, 12)
    for step in range(HALF + 1, STEPS + 1):
        assert second["losses"][str(step)] == pytest.approx(full["losses"][str(step)], rel=1e-5), step
    assert second["weights"].keys() == full["weights"].keys()
    for name, value in second["weights"].items():
        assert value == pytest.approx(full["weights"][name], rel=1e-6, abs=1e-6), name


@pytest.mark.launcher
def test_export_reloads_with_the_engines_logits(whole: tuple[Path, dict[str, Any]], tiny_data: Path) -> None:
    out, report = whole
    assert report["export"]["ok"] and report["export"]["max_abs_logit_diff"] <= 1e-3
    hf = out / "hf"
    assert list(hf.glob("*.safetensors")) and not list(hf.glob("*.bin")) and (hf / "tokenizer.json").is_file()
    assert AutoConfig.from_pretrained(hf).model_type == "deepseek_v3"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()
    val = PackedDataset(tiny_data, "val")
    batch = {k: torch.stack([val[0][k], val[1][k]]) for k in ("input_ids", "labels", "shift_labels")}
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert loss == pytest.approx(report["pipeline_loss_after"], rel=1e-3)
