"""Pipeline parallelism: stages equal the HF model in one process; train.py on 3 real ranks trains the pipeline with
the plain model's loss curve, the loss falls, a resumed run continues the uninterrupted one exactly, and the Hugging
Face export reloads with the engine's evaluation loss."""

from __future__ import annotations

import collections
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NATIVE_16BIT, REPO, bf16_precision, cpu_env, launch, losses, records
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from deepzero import dsconfig, modeling
from deepzero.data import GlobalBatchSampler, PackedDataset, make_eval_loader, make_train_loader
from deepzero.engines.pipeline import (
    PipelineSettings,
    build_name_map,
    causal_lm_loss,
    pipeline_batches,
    sequential_forward,
    to_pipeline_layers,
)
from deepzero.errors import UserError
from deepzero.presets import get_preset

STEPS = 12
HALF = STEPS // 2
REF_STEPS = 4
"""Steps compared with the plain model (2 of warmup, 2 at the peak lr)."""


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


def count_mask_builds(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Calls of Transformers' causal-mask builders from now on, by name."""
    import transformers.masking_utils as masking

    calls: collections.Counter[str] = collections.Counter()

    def counted(name: str, make: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return make(*args, **kwargs)

        return wrapper

    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        monkeypatch.setattr(masking, name, counted(name, getattr(masking, name)))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2_sliding"])
@torch.no_grad()
def test_the_mask_is_built_once_per_micro_batch_not_per_layer(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_models()[family], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    layers = to_pipeline_layers(model)
    sliding = sum(getattr(layer, "_sliding", False) for layer in layers)
    assert sliding == (0 if family == "llama" else 2)  # of 3 decoder layers
    once = {"create_causal_mask": 1} | ({"create_sliding_window_causal_mask": 1} if sliding else {})
    calls = count_mask_builds(monkeypatch)
    ids = torch.randint(0, 128, (2, 16))
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, -1).clone()  # two documents per row
    packed = sequential_forward(layers, ids, positions)
    assert dict(calls) == once  # one build per mask kind for all the layers (before: one per layer)
    assert torch.equal(packed, model(input_ids=ids, position_ids=positions, use_cache=False).logits)
    positions.copy_(torch.arange(16))  # the same tensor rewritten in place: a new micro-batch, so a new mask
    stream = sequential_forward(layers, ids, positions)
    assert dict(calls) == {name: 2 for name in once}
    assert torch.equal(stream, model(input_ids=ids, use_cache=False).logits)
    assert (stream - packed).abs().max() > 1e-3  # the packed row's mask was not reused for the single sequence


def test_pipeline_batches_feed_inputs_and_shifted_labels(tiny_data: Path) -> None:
    row = PackedDataset(tiny_data, "val")[0]
    batch = {k: v.unsqueeze(0) for k, v in row.items()}
    (((inputs, positions), labels),) = list(pipeline_batches([batch]))
    assert torch.equal(inputs, batch["input_ids"]) and torch.equal(labels, batch["labels"])
    assert positions.shape == inputs.shape and positions.dtype == torch.int64
    assert torch.equal(inputs[0, 1:], labels[0, :-1])


def test_preset_resolves_with_the_pipeline_data_parallel_size() -> None:
    raw = dsconfig.load_json("ds_configs/pipeline.json")
    assert raw["_launch"] == "deepspeed --num_gpus=3 train.py --deepspeed_config ds_configs/pipeline.json"
    settings = PipelineSettings.from_ds(raw)
    assert settings == PipelineSettings(3, "parameters", 0)
    dp = settings.dp_size(3)
    hints = dsconfig.TrainingHints(max_steps=10)
    cfg = dsconfig.resolve("ds_configs/pipeline.json", dp_size=dp, hints=hints, kernels=NATIVE_16BIT)
    assert (cfg.batch.micro, cfg.batch.accum, cfg.batch.dp_size, cfg.batch.global_batch) == (2, 6, 1, 12)
    assert cfg.is_pipeline and cfg.precision == "bf16" and cfg.zero_stage == 1
    settings.check_batch(cfg.batch)
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
        PipelineSettings(3).check_batch(dsconfig.BatchMath(2, 2, 1))


def test_tied_embeddings_are_refused() -> None:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.vocab_size, config.tie_word_embeddings = 64, True
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match="tied input/output embeddings"):
        to_pipeline_layers(model)


# ---- train.py on launched ranks (CPU accelerator, gloo) -------------------------------------------------------------


def train_args(data: Path, out: Path, preset: str, *extra: str) -> list[str]:
    """train.py on the tiny DeepSeek-V3 preset: seed 0, lr 3e-3 after 2 warmup steps, a record every step."""
    return [
        "--deepspeed_config", preset, "--model", "tiny-deepseek-v3", "--data", str(data), "--out", str(out),
        "--seed", "0", "--lr", "3e-3", "--warmup-steps", "2", "--log-interval", "1", "--eval-batches", "2",
        *extra,
    ]  # fmt: skip


def pipeline_run(data: Path, out: Path, *extra: str) -> str:
    """ds_configs/pipeline.json (3 stages, micro 2 × 6 micro-batches) on 3 ranks; returns stdout."""
    return launch(train_args(data, out, "ds_configs/pipeline.json", *extra), timeout=600).stdout


def whole_args(max_steps: int, *extra: str) -> list[str]:
    """The run the resume test splits: evaluation and checkpoints at HALF and STEPS."""
    return ["--max-steps", str(max_steps), "--eval-interval", str(HALF), "--save-interval", str(HALF), *extra]


def precision(out: Path) -> str:
    return json.loads((out / "run_config.json").read_text())["precision"]["dtype"]


def engine_state(ckpt: Path) -> dict[str, Any]:
    """DeepSpeed's model-states file of a pipeline checkpoint: its engine counters and our client state."""
    return torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


@torch.no_grad()
def first_step_loss(data: Path, dtype: torch.dtype) -> float:
    """The plain HF model's loss in ``dtype`` on step 1's global batch, with train.py's seed-0 initial weights:
    the mean over the 6 micro-batches of 2 that GlobalBatchSampler gives step 1 (the same for any world size)."""
    source = modeling.resolve_model("tiny-deepseek-v3")
    torch.manual_seed(0)
    vocab = len(modeling.load_tokenizer(str(data / "tokenizer")))
    model = modeling.build_model(source, modeling.load_config(source), vocab_size=vocab).to(dtype).eval()
    train = PackedDataset(data, "train")
    loader = make_train_loader(train, GlobalBatchSampler(len(train), 2, 6, 0, 1, 0))
    step_losses = [model(**batch).loss.item() for batch in itertools.islice(loader, 6)]
    return sum(step_losses) / len(step_losses)


@pytest.fixture(scope="module")
def whole(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The pipeline preset as shipped (bf16 where this CPU computes it natively) for STEPS steps, with export."""
    out = tmp_path_factory.mktemp("pipe") / "whole"
    return out, pipeline_run(tiny_data, out, *whole_args(STEPS))


@pytest.fixture(scope="module")
def plain_fp32(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain model: ZeRO-2 on one rank in fp32 with the pipeline's global batch (micro 2 × accumulation 6).

    GlobalBatchSampler gives every world size the same global batches, so each step sees the pipeline's data."""
    out = tmp_path_factory.mktemp("plain") / "fp32"
    args = train_args(tiny_data, out, "ds_configs/zero2.json", "--precision", "fp32", "--max-steps", str(REF_STEPS))
    args += ["--micro-batch", "2", "--grad-accum", "6", "--eval-interval", "0", "--save-interval", "0", "--no-export"]
    proc = launch(args, nproc=1, timeout=600)
    assert "micro 2 × accumulation 6 × data-parallel 1 = global 12" in proc.stdout
    return out


@pytest.mark.launcher
def test_each_rank_builds_the_mask_once_per_micro_batch(tmp_path: Path) -> None:
    """tests/helpers/pipeline_masks.py: a real 3-stage engine trains a step of 3 packed micro-batches."""
    out = tmp_path / "masks.json"
    env = cpu_env(PYTHONPATH=str(REPO))
    launch(["--out", str(out)], env=env, timeout=600, script="tests/helpers/pipeline_masks.py")
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["decoder_layers"] for r in ranks] == [2, 1, 1]  # type:DecoderStage over 4 layers
    for r in ranks:
        micro = r["micro_batches"]
        assert r["mask_builds"] == {"create_causal_mask": micro}, r  # before: decoder_layers × micro
        assert r["syncs"]["transformers/masking_utils.py"] == micro, r  # its packed-row check, once per build
        assert r["max_abs_logit_diff"] <= 1e-5, r  # packed documents stay masked through the stages
    assert len({r["loss"] for r in ranks}) == 1


@pytest.mark.launcher
def test_fp32_pipeline_loss_equals_the_plain_model(tiny_data: Path, tmp_path: Path, plain_fp32: Path) -> None:
    out = tmp_path / "fp32"
    log = pipeline_run(tiny_data, out, "--precision", "fp32", "--max-steps", str(REF_STEPS), "--eval-interval", "0")
    assert "pipeline 3 stages × data-parallel 1" in log and "ZeRO-1  fp32" in log
    assert precision(out) == precision(plain_fp32) == "fp32"
    pipe, plain = records(out), records(plain_fp32)
    assert [r["step"] for r in pipe] == [r["step"] for r in plain] == list(range(1, REF_STEPS + 1))
    for a, b in zip(pipe, plain, strict=True):
        assert a["lr"] == b["lr"], a["step"]  # same schedule, so the losses compare the models
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
    export = records(out, "export")[-1]
    assert export["ok"] and export["dtype"] == "float32" and export["max_abs_logit_diff"] <= 1e-5


@pytest.mark.launcher
def test_bf16_pipeline_loss_equals_the_plain_model(whole: tuple[Path, str], plain_fp32: Path, tiny_data: Path) -> None:
    out, log = whole
    assert precision(out) == bf16_precision() and f"ZeRO-1  {bf16_precision()}" in log
    assert "pipeline 3 stages × data-parallel 1" in log
    assert "micro 2 × accumulation 6 × data-parallel 1 = global 12" in log
    sizes = [int(n) for n in re.findall(r"^stage=\d+ layers=(\d+)$", log, re.MULTILINE)]  # DeepSpeed's partition
    assert len(sizes) == 3 and sum(sizes) == 6 and all(sizes), sizes  # embedding + 4 decoder layers + head
    pipe, ref = losses(out), losses(plain_fp32)
    for step in range(1, REF_STEPS + 1):
        assert pipe[step] == pytest.approx(ref[step], rel=2e-2), step
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[bf16_precision()]
    assert first_step_loss(tiny_data, torch.float32) == pytest.approx(ref[1], rel=1e-5)  # the reference's own check
    assert pipe[1] == pytest.approx(first_step_loss(tiny_data, dtype), rel=2e-2)


@pytest.mark.launcher
def test_loss_falls(whole: tuple[Path, str]) -> None:
    out, _ = whole
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1)) and records(out)[-1]["step"] == STEPS
    assert engine_state(out / "checkpoints" / f"step{STEPS:08d}")["global_steps"] == STEPS  # the engine's own count
    first, last = curve[1], sum(curve[s] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert first > 6.0 and last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [HALF, STEPS]
    assert evals[-1]["val_loss"] < first - 0.5  # step 1's loss is the untrained model's
    assert all(r["grad_norm"] > 0 for r in records(out))


@pytest.mark.launcher
def test_resume_continues_the_uninterrupted_run_exactly(
    whole: tuple[Path, str], tiny_data: Path, tmp_path: Path
) -> None:
    full, _ = whole
    out = tmp_path / "split"
    pipeline_run(tiny_data, out, *whole_args(HALF, "--no-export"))
    ckpt = out / "checkpoints" / f"step{HALF:08d}"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    assert sorted(p.name for p in ckpt.glob("layer_*-model_states.pt")) == [
        f"layer_{i:02d}-model_states.pt" for i in range(6)
    ]
    assert engine_state(ckpt)["global_steps"] == HALF and engine_state(ckpt)["deepzero"]["step"] == HALF
    log = pipeline_run(tiny_data, out, *whole_args(STEPS, "--resume"))
    assert f"resumed from step {HALF}" in log
    assert (out / "checkpoints" / "latest").read_text() == f"step{STEPS:08d}"
    assert engine_state(out / "checkpoints" / f"step{STEPS:08d}")["global_steps"] == STEPS
    resumed, reference = losses(out), losses(full)
    assert sorted(resumed) == list(range(1, STEPS + 1)) and records(out)[-1]["step"] == STEPS
    for step in range(HALF + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), step
    weights, expected = load_file(out / "hf" / "model.safetensors"), load_file(full / "hf" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.launcher
def test_export_reloads_with_the_engines_logits(whole: tuple[Path, str], tiny_data: Path) -> None:
    out, _ = whole
    export = records(out, "export")[-1]
    assert export["ok"] and export["max_abs_logit_diff"] <= 1e-3
    hf = out / "hf"
    assert list(hf.glob("*.safetensors")) and not list(hf.glob("*.bin")) and (hf / "tokenizer.json").is_file()
    assert AutoConfig.from_pretrained(hf).model_type == "deepseek_v3"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=getattr(torch, export["dtype"])).eval()
    # The final evaluation's batches (trainer.evaluate): data-parallel 1, so the first eval_batches × micro val rows.
    val, micro, eval_batches = PackedDataset(tiny_data, "val"), 2, 2
    with torch.no_grad():
        loader = make_eval_loader(val, micro, 0, 1, max_rows=eval_batches * micro)
        per_batch = [model(**batch).loss.item() for batch in loader]
    assert len(per_batch) == eval_batches
    final = records(out, "eval")[-1]
    assert final["step"] == STEPS
    assert sum(per_batch) / len(per_batch) == pytest.approx(final["val_loss"], rel=1e-3)
