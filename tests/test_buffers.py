"""fp32 where bf16 rounding would hurt training: the buffers, and the gradient accumulation.

Buffers: RoPE's ``inv_freq`` (bf16 rounding shifts the rotary phases) and DeepSeek-V3's ``e_score_correction_bias``
stay fp32 after every engine's build (``deepspeed.initialize``) and in its Hugging Face export. Accumulation: the
bf16 presets' ``data_types.grad_accum_dtype`` fp32 gives an 8-micro-step gradient closer to fp32 training's than
bf16 accumulation does.

ZeRO-2, ZeRO-3 and the pipeline are built by the product's ``setup`` in one 3-rank launch of this file (its
``__main__`` half, below), after it measures the accumulation; the layer split and the pretrained load run
in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, cpu_env, launch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from deepzero import modeling
from deepzero.presets import get_preset

MODEL = "tiny-deepseek-v3"
BIAS = "e_score_correction_bias"
ENGINES = {  # name -> (preset, batch flags): pipeline.json's 3 stages need >= 3 micro-batches per step
    "zero2": ("ds_configs/zero2_bf16.json", ["--micro-batch", "1", "--grad-accum", "1"]),
    "zero3": ("ds_configs/zero3.json", ["--micro-batch", "1", "--grad-accum", "1"]),
    "pipeline": ("ds_configs/pipeline.json", ["--micro-batch", "1", "--grad-accum", "3"]),  # last: sets DeepSpeed's mpu
}


def buffer_record(model: torch.nn.Module) -> dict[str, Any]:
    """The dtypes of ``model``'s rotary and routing-bias buffers, the inv_freq values, and the weights' dtype."""
    buffers = {n: b for n, b in model.named_buffers() if n.endswith(("inv_freq", BIAS))}
    return {
        "weights": str(model.get_input_embeddings().weight.dtype),
        "buffers": {n: str(b.dtype) for n, b in buffers.items()},
        "inv_freq": buffers["model.rotary_emb.inv_freq"].tolist(),
        "biases": sum(n.endswith(BIAS) for n in buffers),
    }


def fp32_inv_freq() -> list[float]:
    """The preset's rotary frequencies as an fp32 model computes them."""
    return AutoModelForCausalLM.from_config(get_preset(MODEL).config()).model.rotary_emb.inv_freq.tolist()


def check_fp32_buffers(record: dict[str, Any], reference: list[float]) -> None:
    assert record["weights"] == "torch.bfloat16"
    assert record["biases"] == 3 and set(record["buffers"].values()) == {"torch.float32"}, record["buffers"]
    assert record["inv_freq"] == reference  # exactly: bf16 would round e.g. 0.316228 to 0.316406


def check_export(folder: Path, reference: list[float]) -> None:
    """The safetensors hold bf16 weights and fp32 routing biases; the reloaded model's buffers are fp32."""
    with safe_open(folder / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert dtypes["model.embed_tokens.weight"] == "BF16"
    assert sorted(v for k, v in dtypes.items() if k.endswith(BIAS)) == ["F32"] * 3
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    check_fp32_buffers(buffer_record(reloaded), reference)


@pytest.fixture(scope="module")
def launched(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 3-rank launch of this file's ``__main__`` half: the accumulation errors, then the engines' buffers."""
    out = tmp_path_factory.mktemp("buffers")
    env = cpu_env(PYTHONPATH=str(REPO))
    launch([str(tiny_data), str(out)], env=env, timeout=1200, script="tests/test_buffers.py")
    return out


@pytest.mark.launcher
def test_zero2_zero3_and_pipeline_keep_fp32_buffers_in_bf16(launched: Path) -> None:
    reference = fp32_inv_freq()
    for name in ENGINES:
        result = json.loads((launched / f"{name}.json").read_text())
        check_fp32_buffers(result["after_initialize"], reference)
        assert result["export_ok"], name
        check_export(launched / name / "hf", reference)


def test_layer_split_casts_weights_only(tiny_data: Path, tmp_path: Path) -> None:
    """The layer split's own bf16 cast (no DeepSpeed engine), planned and built as train.py does: weights bf16,
    buffers fp32, the export likewise."""
    from functools import partial

    from deepzero.args import parse_args
    from deepzero.run import make_model, plan_run

    argv = ["--device-map", "balanced", "--device-map-devices", "cpu,cpu", "--model", MODEL, "--precision", "bf16"]
    argv += ["--deepspeed_config", "ds_configs/zero2_bf16.json", "--ds", "train_batch_size=auto", "--micro-batch", "1"]
    args = parse_args([*argv, "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--moe-balance", "off"])
    plan = plan_run(args, world=1)
    engine = plan.engine_settings.build(partial(make_model, args, plan), plan.cfg.ds, plan.seq_len)
    reference = fp32_inv_freq()
    check_fp32_buffers(buffer_record(engine.model), reference)
    report = engine.export(None, tmp_path / "hf", {"input_ids": torch.randint(0, 100, (1, 16))})
    assert report is not None and report.ok, report
    check_export(tmp_path / "hf", reference)


def test_pretrained_bf16_load_keeps_the_routing_bias_values(tmp_path: Path) -> None:
    """build_model loads a checkpoint in the training dtype: weights bf16, the bias keeps values bf16 would round."""
    model = AutoModelForCausalLM.from_config(get_preset(MODEL).config())
    bias = [b for n, b in model.named_buffers() if n.endswith(BIAS)]
    for b in bias:
        b.copy_(1.0 + torch.arange(b.numel()) * 1e-3)  # bf16's step at 1.0 is 2**-7 = 0.0078
    model.save_pretrained(tmp_path)
    loaded = modeling.build_model(modeling.resolve_model(str(tmp_path)), model.config, dtype=torch.bfloat16)
    check_fp32_buffers(buffer_record(loaded), fp32_inv_freq())
    loaded_bias = [b for n, b in loaded.named_buffers() if n.endswith(BIAS)]
    assert all(torch.equal(a, b) for a, b in zip(bias, loaded_bias, strict=True))


ACCUM = {  # variant -> train.py flags over a bf16 preset (whose data_types.grad_accum_dtype is fp32)
    "bf16, bf16 accumulation": [
        "--precision",
        "bf16",
        "--ds",
        "train_batch_size=auto",
        "data_types.grad_accum_dtype=bf16",
    ],
    "bf16, fp32 accumulation": ["--precision", "bf16", "--ds", "train_batch_size=auto"],
}
REFERENCE = ["--precision", "fp32", "--ds", "train_batch_size=auto"]
"""fp32 training, per stage: ZeRO-3 initialises its partitioned weights with other random draws than ZeRO-2."""
ACCUM_PRESETS = {"ZeRO-2": "ds_configs/zero2_bf16.json", "ZeRO-3": "ds_configs/zero3.json"}


@pytest.mark.launcher
def test_fp32_accumulation_is_closer_to_the_fp32_gradient(launched: Path) -> None:
    """The gradient after 8 accumulation micro-steps of one step, from the same weights and batches: bf16
    accumulation vs fp32 accumulation (the presets' setting) vs fp32 training, relative error ||g - g_fp32|| /
    ||g_fp32|| over all parameters (docs/precision.md has the numbers)."""
    errors = json.loads((launched / "accum.json").read_text())
    print(json.dumps(errors, indent=1))
    for stage, err in errors.items():
        bf16_accum, fp32_accum = err["bf16, bf16 accumulation"], err["bf16, fp32 accumulation"]
        assert 0 < fp32_accum < bf16_accum, (stage, err)


def accumulated_gradient(argv: list[str]) -> dict[str, torch.Tensor]:
    """One train_step of the product's engine; every parameter's full gradient at the accumulation boundary (read
    just before DeepSpeed's optimizer step consumes it), in float64 on the CPU."""
    import contextlib

    from deepspeed.utils import safe_get_full_grad

    from deepzero.args import parse_args
    from deepzero.run import setup
    from deepzero.trainer import micro_batches

    run = setup(parse_args(argv))
    engine, grads = run.engine.engine, {}
    original_step = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            for name, param in run.engine.model.named_parameters():
                grads[name] = safe_get_full_grad(param).detach().double().cpu()
        return original_step(*args, **kwargs)

    engine.step = step
    with contextlib.closing(micro_batches(run)) as batches:
        run.engine.train_step(batches)
    run.sink.close()
    return grads


def accumulation_errors(data: str, out: str) -> None:
    """On every rank: each variant of ``ACCUM`` per preset; rank 0 writes the relative errors to ``accum.json``."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    def gradient(preset: str, flags: list[str], folder: str) -> dict[str, torch.Tensor]:
        argv = ["--deepspeed_config", preset, "--model", MODEL, "--moe-balance", "off", "--data", data]
        grads = accumulated_gradient(
            [*argv, "--out", f"{out}/{folder}", "--micro-batch", "2", "--grad-accum", "8", *flags]
        )
        unset_hf_deepspeed_config()
        return grads

    errors: dict[str, dict[str, float]] = {}
    for stage, preset in ACCUM_PRESETS.items():
        ref = gradient(preset, REFERENCE, f"{stage}-reference")
        norm = sum(float(g.pow(2).sum()) for g in ref.values()) ** 0.5
        errors[stage] = {}
        for i, (variant, flags) in enumerate(ACCUM.items()):
            grads = gradient(preset, flags, f"{stage}-{i}")
            errors[stage][variant] = sum(float((grads[n] - ref[n]).pow(2).sum()) for n in ref) ** 0.5 / norm
    if dist.get_rank() == 0:
        (Path(out) / "accum.json").write_text(json.dumps(errors))


def rank_main(data: str, out: str) -> None:
    """On every rank: build each engine as train.py does (bf16, balancing off so nothing repairs the bias), record
    its buffers, export; rank 0 writes ``<out>/<engine>.json``."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from deepzero.args import parse_args
    from deepzero.data import make_eval_loader
    from deepzero.engines.base import to_device
    from deepzero.run import setup

    for name, (preset, batch) in ENGINES.items():
        argv = ["--deepspeed_config", preset, "--model", MODEL, "--precision", "bf16", "--moe-balance", "off"]
        argv += ["--data", data, "--out", f"{out}/{name}", "--ds", "train_batch_size=auto", *batch]
        run = setup(parse_args(argv))
        record = buffer_record(run.engine.model)
        loader = make_eval_loader(run.val_data or run.train_data, 1, 0, 1, 1)
        report = run.engine.export(run.tokenizer, Path(out) / name / "hf", next(to_device(iter(loader), "cpu")))
        run.sink.close()
        unset_hf_deepspeed_config()  # as if in its own process: ZeRO-3's zero.Init must not build the next model
        if dist.get_rank() == 0:
            result = {"after_initialize": record, "export_ok": report.ok}
            (Path(out) / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from deepzero.distributed import exit_process

    data, out = (a for a in sys.argv[1:] if not a.startswith("--local_rank"))
    accumulation_errors(data, out)  # first: rank_main's pipeline, built last, sets DeepSpeed's global mpu
    rank_main(data, out)
    exit_process(0)
