"""QLoRA (--load-in-4bit): the refusals in one line (in process), and 3-rank runs of train.py on tiny pretrained
folders: ZeRO-2 (Llama, 4-bit blocks as uint8, whole on every rank) and ZeRO-3 (Qwen2, gradient checkpointing, 4-bit
blocks stored as fp32 and partitioned). Each: the header names the 4-bit base, the loss falls, and the export is the
adapters merged into the 16-bit base read again from the folder (loadable without peft or bitsandbytes) plus the
adapters alone in peft's format. DPO and GRPO on a 4-bit base: tests/test_preference.py, tests/test_grpo.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import launch, losses, records
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from deepzero.args import parse_args
from deepzero.errors import UserError
from deepzero.run import plan_run

STEPS = 10
ARCH = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
RUNS = {
    "zero2": (LlamaForCausalLM, LlamaConfig, ["--deepspeed_config", "ds_configs/zero2.json"]),
    "zero3": (
        Qwen2ForCausalLM,
        Qwen2Config,
        ["--deepspeed_config", "ds_configs/zero3.json", "--gradient-checkpointing"],
    ),
}
TRAIN = [
    "--lora", "r=8,targets=attn", "--load-in-4bit", "--max-steps", str(STEPS), "--lr", "1e-2", "--warmup-steps", "2",
    "--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1", "--eval-interval", str(STEPS),
    "--eval-batches", "2", "--save-interval", "5", "--keep-last", "2",
]  # fmt: skip


HPZ = ["--ds", "zero_optimization.zero_hpz_partition_size=3"]


def pretrained(folder: Path, name: str = "zero2") -> Path:
    """A tiny random model saved in bf16 by save_pretrained: the '16-bit base' a 4-bit run quantises."""
    model_cls, config_cls, _ = RUNS[name]
    torch.manual_seed(0)
    model_cls(config_cls(**ARCH)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def pretrained_moe(folder: Path, preset: str = "tiny-deepseek-v2") -> Path:
    """A tiny random DeepSeek MoE (fused routed experts) saved in bf16: a base whose experts are quantised too."""
    from deepzero.presets import get_preset

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_preset(preset).config(vocab_size=512)).to(torch.bfloat16).save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="module")
def base16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pretrained(tmp_path_factory.mktemp("qlora_base") / "llama")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--load-in-4bit"], "--load-in-4bit: full fine-tuning of a 4-bit base is not possible"),
        (["--lora", "r=8", "--ds", "quantization.load_in_4bit=true"], None),
        (["--lora", "r=8", "--ds", "quantization.load_in_4bit=true", "--load-in-4bit", "false"], "off"),
        (["--lora", "r=8", "--ds", "quantization.bits=4"], "quantization.bits: Unknown config key"),
        (
            ["--lora", "r=8", "--load-in-4bit", "--deepspeed_config", "ds_configs/zero3_offload.json"],
            "parameter offload of 4-bit weights is not supported",
        ),
        (
            [*["--lora", "r=8", "--load-in-4bit", "--deepspeed_config", "ds_configs/zero3.json"], *HPZ],
            "hierarchical partitioning",
        ),
    ],
)
def test_the_flag_the_preset_key_and_the_refusals(base16: Path, tiny_data: Path, extra: list, message: str) -> None:
    args = parse_args(["--model", str(base16), "--data", str(tiny_data), "--out", "/tmp/unused", *extra])
    if message in (None, "off"):
        plan = plan_run(args, 3)
        assert (plan.four_bit is None) == (message == "off")
        if plan.four_bit is not None:
            assert plan.four_bit.origin == "ds_configs/zero2.json: quantization.load_in_4bit"
            assert plan.engine_settings.four_bit == plan.four_bit and plan.engine_settings.base_source == str(base16)
        return
    with pytest.raises(UserError, match=message) as err:
        plan_run(args, 3)
    assert "\n" not in str(err.value)


def test_a_base_that_is_quantised_already_is_refused(base16: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A hub checkpoint saved in 4 bits (a quantization_config in its config.json) has no 16-bit weights for the
    export to merge into: refused at plan time, in one line."""
    quantised = tmp_path / "bnb-4bit"
    shutil.copytree(base16, quantised)
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(config))
    args = parse_args(["--model", str(quantised), "--data", str(tiny_data), "--out", str(tmp_path / "run")])
    args.lora, args.load_in_4bit = "r=8", True
    with pytest.raises(UserError, match="has a quantization_config: its weights are quantised already") as err:
        plan_run(args, 3)
    assert "\n" not in str(err.value)


def test_a_random_init_preset_is_refused(tiny_data: Path) -> None:
    args = parse_args(["--model", "tiny-deepseek-v3", "--data", str(tiny_data), "--out", "/tmp/unused"])
    args.lora, args.load_in_4bit = "r=8", True
    with pytest.raises(UserError, match="a random-init preset has no weights to quantise"):
        plan_run(args, 3)


def test_ranks_that_loaded_different_bases_stop_in_one_line(base16: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ZeRO-3 each rank loads and partitions the 4-bit base alone (no broadcast from rank 0), so the ranks
    compare what they loaded: a rank whose copy differs in one byte of one tensor stops every rank in one line."""
    from deepzero.adapters import partitioned_load, quant

    bnb = quant.FourBit("fp32", "fp32").bnb_config()
    model = AutoModelForCausalLM.from_pretrained(base16, quantization_config=bnb, device_map={"": "cpu"})
    prints = partitioned_load.fingerprint(model)
    states = quant.quant_states(model)
    assert states and len(prints) == len(list(model.parameters())) + len(states)
    assert prints == partitioned_load.fingerprint(model)
    other = list(prints)
    other[3] += 1
    monkeypatch.setattr(partitioned_load.dist, "get_world_size", lambda: 3)

    def gather(out: list, mine: list) -> None:
        out[:] = [mine, mine, other]

    monkeypatch.setattr(partitioned_load.dist, "all_gather_object", gather)
    with pytest.raises(UserError, match=r"ranks \[2\] loaded a different 4-bit base from rank 0") as err:
        partitioned_load.check_same_everywhere(prints)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(
        partitioned_load.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine] * 3)
    )
    partitioned_load.check_same_everywhere(prints)


def test_a_resume_onto_another_quant_state_is_refused_in_one_line(base16: Path) -> None:
    """The same files and codes quantised with other block scales (bitsandbytes' CPU statistics followed the thread
    count in their last bits) dequantise to another base: each QuantState is in the fingerprint (absmax, code,
    blocksize, quant type, dtype, the nested state), and a resume that loaded another one is refused in one line."""
    from deepzero.adapters import checkpoint, partitioned_load, quant

    bnb = quant.FourBit("fp32", "uint8").bnb_config()
    model = AutoModelForCausalLM.from_pretrained(base16, quantization_config=bnb, device_map={"": "cpu"})
    saved = checkpoint.base_fingerprint(partitioned_load.fingerprint(model), "uint8")
    state = quant.quant_states(model)[2]
    codes = [p.clone() for p in model.parameters()]
    changes = [
        ("absmax", lambda s: s.absmax.view(torch.uint8)[0].add_(1)),  # one block's scale, in its last bits
        ("nested absmax", lambda s: s.state2.absmax.view(torch.uint8)[0].add_(1)),
        ("code", lambda s: s.code.view(torch.uint8)[0].add_(1)),
        ("blocksize", lambda s: setattr(s, "blocksize", 128)),
        ("quant_type", lambda s: setattr(s, "quant_type", "fp4")),
    ]
    for what, change in changes:
        before = (
            state.absmax.clone(),
            state.state2.absmax.clone(),
            state.code.clone(),
            state.blocksize,
            state.quant_type,
        )
        change(state)
        own = checkpoint.base_fingerprint(partitioned_load.fingerprint(model), "uint8")
        assert own["tensors"] == saved["tensors"] and own["crc32"] != saved["crc32"], what
        with pytest.raises(UserError, match="was trained on another 4-bit base") as err:
            checkpoint.check_same_base(saved, own, "--resume (run/checkpoints/step00000005)", str(base16))
        assert "\n" not in str(err.value), what
        state.absmax.copy_(before[0]), state.state2.absmax.copy_(before[1]), state.code.copy_(before[2])
        state.blocksize, state.quant_type = before[3], before[4]
    assert all(torch.equal(a, b) for a, b in zip(codes, model.parameters(), strict=True))  # the codes never moved
    checkpoint.check_same_base(saved, checkpoint.base_fingerprint(partitioned_load.fingerprint(model), "uint8"), "", "")
    # A checkpoint written before the QuantState was fingerprinted holds the parameters' record only: still resumable.
    prints, states = partitioned_load.fingerprint(model), len(quant.quant_states(model))
    own = checkpoint.base_fingerprint(prints, "uint8", states)
    params = prints[: len(prints) - states]
    keep = ("tensors", "crc32", "storage")
    old = {k: v for k, v in checkpoint.base_fingerprint(params, "uint8").items() if k in keep}
    checkpoint.check_same_base(old, own, "", "")
    params[0] ^= 1  # its parameters were another base's
    other = {k: v for k, v in checkpoint.base_fingerprint(params, "uint8").items() if k in keep}
    with pytest.raises(UserError, match="was trained on another 4-bit base"):
        checkpoint.check_same_base(other, own, "", "")


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def qlora_run(request: pytest.FixtureRequest, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """10 steps with checkpoints at 5 and 10, and the same run resumed from step 5 in a copy of its folder: what a
    job SIGKILLed anywhere in steps 6-10 leaves (checkpoints are published atomically), metrics.jsonl gone."""
    root = tmp_path_factory.mktemp(f"qlora_{request.param}")
    base = pretrained(root / "base", request.param)
    out = root / "run"
    args = [*RUNS[request.param][2], "--model", str(base), "--data", str(tiny_data), *TRAIN]
    proc = launch([*args, "--out", str(out)], timeout=600)
    resumed = root / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("hf", "hf-adapter", "metrics.jsonl"))
    (resumed / "checkpoints" / "latest").write_text("step00000005")
    again = launch([*args, "--out", str(resumed), "--resume", "--no-export"], timeout=600)
    return request.param, base, out, proc.stdout, resumed, again.stdout


@pytest.mark.launcher
def test_qlora_trains_and_the_header_names_the_4bit_base(qlora_run: tuple) -> None:
    name, base, out, log, *_ = qlora_run
    config = json.loads((out / "run_config.json").read_text())
    compute = config["precision"]["dtype"]  # the preset's on a CPU with native 16-bit kernels, else fp32
    storage = compute if name == "zero3" else "uint8"
    turns = ", read on the host one rank at a time" if name == "zero3" else ""
    header = f"base in 4 bits (NF4, double quant, compute {compute}, storage {storage}{turns})"
    assert header in log, log[-3000:]
    # counts are weights, not the packed codes' elements (8 weights per fp32 element here)
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    adapters = 2 * (2 * (8 * 64 + 64 * 8) + 2 * (8 * 64 + 32 * 8))  # r8 on q, o (64 -> 64) and k, v (64 -> 32)
    assert f"trainable {adapters:,} of {weights + adapters:,} params" in log, log[-3000:]
    assert "world 3 on cpu (gloo)" in log and ("partitioned at load" in log) == (name == "zero3")
    curve = [losses(out)[s] for s in range(1, STEPS + 1)]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.02, curve
    assert config["four_bit"] == {"quant_type": "nf4", "double_quant": True, "compute": compute, "storage": storage}


@pytest.mark.launcher
def test_export_merges_into_the_16bit_base_and_loads_without_peft_or_bitsandbytes(
    qlora_run: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, base, out, *_ = qlora_run
    (export,) = records(out, "export")
    assert export["ok"] and export["dtype"] == "bfloat16" and not export["problems"], export
    adapted = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    # each adapted tensor is W + (alpha/r)·B·A of the source's own, every other one the source's bytes
    assert export["merged_tensors"] == export["moved_tensors"] == len(adapted), export
    assert export["unchanged_tensors"] == export["tensors"] - len(adapted) > 0
    # the user's round trip: the source with hf-adapter applied by stock peft, unmerged, gives the merged logits
    assert export["peft"].startswith("stock peft") and export["peft"].endswith("loads it as trained"), export
    assert export["max_abs_logit_diff"] <= export["tolerance"] and "unmerged" in export["logit_check"]
    assert export["p99_token_logit_diff"] <= export["max_abs_logit_diff"] and export["tokens_over_tolerance"] == 0
    adapter = Path(export["adapter_path"])
    assert adapter == out / "hf-adapter" and (adapter / "adapter_config.json").is_file()
    lora = load_file(adapter / "adapter_model.safetensors")
    assert lora and all(".lora_A." in k or ".lora_B." in k for k in lora)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base)
    assert sorted(adapter_config["target_modules"]) == sorted(adapted)  # full paths: read one way only

    for mod in [m for m in sys.modules if m.split(".")[0] in ("peft", "bitsandbytes")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    model, info = AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert "quantization_config" not in json.loads((out / "hf" / "config.json").read_text())
    original = load_file(base / "model.safetensors")
    exported = load_file(out / "hf" / "model.safetensors")
    assert set(exported) == set(original)
    # the MLP was quantised in the engine but never adapted: the export holds its 16-bit weights bit for bit, so
    # the base was read again from the folder, not dequantised from NF4
    mlp = [k for k in original if ".mlp." in k]
    assert mlp and all(torch.equal(exported[k], original[k]) for k in mlp)
    # an adapted layer: W + B·A·alpha/r, from the adapters written beside the export
    key = "model.layers.0.self_attn.q_proj.weight"
    a, b = (lora[f"base_model.model.{key[:-7]}.lora_{x}.weight"].float() for x in "AB")
    expected = (original[key].float() + 2.0 * b @ a).to(torch.bfloat16)
    assert not torch.equal(exported[key], original[key])
    torch.testing.assert_close(exported[key], expected, rtol=0, atol=float(expected.abs().max()) * 2**-7)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()


@pytest.mark.launcher
def test_qlora_resumes_bit_exactly_from_a_checkpoint_that_holds_only_the_adapters(qlora_run: tuple) -> None:
    """Steps 6-10 resumed from the step-5 checkpoint equal the uninterrupted run's, loss and grad norm, to the bit.
    The checkpoint holds the adapters, their optimizer state and the base's fingerprint: no 4-bit code, no
    QuantState entry, no frozen 16-bit weight (its size follows the adapters, not the base)."""
    name, _, out, _, resumed, log = qlora_run
    assert "resumed from step 5" in log, log[-3000:]
    full = {r["step"]: r for r in records(out)}
    again = {r["step"]: r for r in records(resumed)}
    assert sorted(again) == list(range(6, STEPS + 1))
    for step in again:
        assert (again[step]["loss"], again[step]["grad_norm"]) == (full[step]["loss"], full[step]["grad_norm"]), step
    folder = out / "checkpoints" / "step00000005"
    states = torch.load(next(folder.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    assert states["module"] and all(".lora_" in key for key in states["module"]), list(states["module"])[:5]
    assert not states.get("frozen_param_fragments") and states["four_bit_base"]["tensors"] > 0
    stored = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    adapters = sum(t.numel() for t in states["module"].values()) if name == "zero2" else 7168
    assert stored < 16 * adapters + 200_000, stored  # fp32 master + Adam's moments, plus pickling overhead


@pytest.mark.launcher
@pytest.mark.parametrize("qlora_run", ["zero2"], indirect=True)  # one launch: the check is the same for every stage
def test_a_resume_on_another_base_or_world_size_stops_in_one_line(
    qlora_run: tuple, tiny_data: Path, tmp_path: Path
) -> None:
    _, base, out, *_ = qlora_run
    other = pretrained(tmp_path / "other", "zero2")
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    from safetensors.torch import save_file

    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    shutil.copytree(out / "checkpoints", run / "checkpoints")
    args = [*RUNS["zero2"][2], "--data", str(tiny_data), "--out", str(run), *TRAIN, "--resume", "--no-export"]
    proc = launch([*args, "--model", str(other)], timeout=600, check=False)
    assert proc.returncode != 0
    line = "was trained on another 4-bit base ("
    errors = [x for x in proc.stderr.splitlines() if line in x]
    assert errors and f"--model {other} loads now" in errors[0], proc.stderr[-3000:]
    proc = launch([*args, "--model", str(base)], nproc=2, timeout=600, check=False)
    assert proc.returncode != 0
    assert "was saved by 3 data-parallel ranks, this run has 2; a checkpoint over a 4-bit base" in proc.stderr


@pytest.mark.launcher
def test_the_offline_export_of_a_qlora_checkpoint_gives_the_runs_own_folders(qlora_run: tuple, tmp_path: Path) -> None:
    """python -m deepzero.export of the last checkpoint (adapters only): the same merged shards and adapter tensors,
    byte for byte, as the run's own export; --dtype is refused in one line."""
    from deepzero.export import main

    _, _, out, *_ = qlora_run
    assert main([str(out), "--out", str(tmp_path / "hf")]) == 0
    for name in ("hf/model.safetensors", "hf-adapter/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / name), load_file(out / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (out / "hf" / "config.json").read_text()
    )
    assert main([str(out), "--out", str(tmp_path / "x"), "--dtype", "bf16"]) == 2


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_the_fused_experts_are_quantised_and_read_back_as_bitsandbytes_dequantises_them(
    tmp_path: Path, storage: torch.dtype
) -> None:
    """``quant.quantise_experts`` on a tiny DeepSeek-V2: every fused expert tensor becomes NF4 codes (uint8, or under
    ZeRO-3 the compute dtype) that the module reads back as exactly bitsandbytes' dequantisation of them; the
    model's other weights are untouched, the counts stay in weights, and LoRA still wraps the shared experts'
    ``down_proj`` (a leaf name the parametrised ``experts.parametrizations.down_proj`` also ends with)."""
    from bitsandbytes import functional as bnb_functional

    from deepzero.adapters import quant
    from deepzero.adapters.lora import LoraSpec, apply_lora
    from deepzero.flops import count_params

    model = AutoModelForCausalLM.from_pretrained(pretrained_moe(tmp_path / "v2"), dtype=torch.bfloat16)
    before = {n: p.clone() for n, p in model.named_parameters()}
    fused = [n for n, p in before.items() if p.dim() == 3]
    assert fused and count_params(model).total == sum(p.numel() for p in before.values())
    four_bit = quant.FourBit("bf16", {torch.uint8: "uint8", torch.bfloat16: "bf16"}[storage], experts=True)
    assert quant.quantise_experts(model, four_bit) == len(fused) and not quant.fused_experts(model)
    assert count_params(model).total == sum(p.numel() for p in before.values())
    for name, original in before.items():
        module_name, key = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if name not in fused:
            assert torch.equal(getattr(module, key), original), name
            continue
        packed = module.parametrizations[key].original
        assert (
            quant.is_packed(packed)
            and packed.dtype == storage
            and packed.numel() * packed.element_size() * 2 == original.numel()
        )
        expected = bnb_functional.dequantize_4bit(packed, module.parametrizations[key][0].quant_state)
        assert torch.equal(getattr(module, key), expected) and expected.shape == original.shape, name
    quant.prepare(model)
    lora = apply_lora(model, LoraSpec.parse("r=4,targets=mlp"), verbose=False)
    wrapped = {n for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert any(n.endswith("shared_experts.down_proj") for n in wrapped)
    assert not any("parametrizations" in n for n in wrapped)


@pytest.mark.launcher
def test_a_v3_base_exports_the_routing_bias_its_balancing_trained(tiny_data: Path, tmp_path: Path) -> None:
    """QLoRA on a DeepSeek-V3 base with the default balancing (the routing bias moves every step): the export
    writes the bias the run trained (the one its last checkpoint holds), not the source's."""

    base = pretrained_moe(tmp_path / "v3", "tiny-deepseek-v3")
    out = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/zero2.json", "--model", str(base), "--data", str(tiny_data)]
    args += ["--out", str(out), "--lora", "r=8,targets=attn", "--load-in-4bit", "--max-steps", "4", "--lr", "1e-2"]
    args += ["--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1", "--eval-interval", "0"]
    proc = launch(args, timeout=600)
    assert "routed experts too, read on the host one rank at a time)" in proc.stdout, proc.stdout[-3000:]
    (export,) = records(out, "export")
    assert export["ok"] and export["trained_buffers"] >= 1, export
    states = torch.load(next((out / "checkpoints" / "step00000004").glob("*model_states.pt")), weights_only=False)
    source, exported = load_file(base / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    biases = [k for k in source if k.endswith("e_score_correction_bias")]
    assert biases
    for key in biases:
        trained = states["module"][f"base_model.model.{key}"].to(source[key].dtype)
        assert torch.equal(exported[key], trained) and not torch.equal(exported[key], source[key]), key


def test_the_4bit_base_is_the_same_bytes_on_any_thread_count(tmp_path: Path) -> None:
    """bitsandbytes' CPU quantiser sums block maxima with torch's threaded reduction, so the NF4 offset and nested
    statistics of a large weight can differ in their last bits between 1 and 2 threads (this 2048 × 4096 one does on
    the 2-core EPYC: offset and state2 both). The base deepzero loads (modeling.build_model quantises on one thread)
    is bit-identical whatever the host's thread count, so a resume on another host finds the same base."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepzero import modeling
    from deepzero.adapters.quant import FourBit

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16, vocab_size=64
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    big = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    model.model.layers[0].mlp.down_proj.weight.data = big  # a weight whose statistics follow the thread count
    model.save_pretrained(tmp_path / "base")

    def loaded(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        source = modeling.resolve_model(str(tmp_path / "base"))
        model = modeling.build_model(
            source, modeling.load_config(source), dtype=torch.bfloat16,
            quantization_config=FourBit("bf16", "uint8").bnb_config(), on_host=True,
        )  # fmt: skip
        states = [p.quant_state for p in model.parameters() if hasattr(p, "quant_state")]
        return [t for s in states for t in (s.absmax, s.offset, s.state2.absmax, s.state2.code)]

    threads = torch.get_num_threads()
    try:
        a, b = loaded(1), loaded(2)
    finally:
        torch.set_num_threads(threads)
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
