"""LoRA via peft: the --lora spec, target resolution per architecture, and 3-rank ZeRO-2 / ZeRO-3 runs of train.py
that train only the adapters and export a merged plain Hugging Face model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import fp16_env, launch, losses, records
from deepspeed.utils.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_files,
    parse_model_states,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from deepzero.adapters.lora import LoraSpec, Targets, apply_lora, is_adapter_param, merged_model, resolve_targets
from deepzero.checkpoint import tag_for
from deepzero.data import PackedDataset, make_eval_loader
from deepzero.errors import UserError
from deepzero.presets import get_preset

ALL_LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
R = 8
STEPS = 8


def tiny(name: str = "tiny-deepseek-v3", vocab: int = 512) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(get_preset(name).config(vocab_size=vocab))


def expected_trainable(model: torch.nn.Module, leaf_names: tuple[str, ...], r: int, experts: bool = False) -> int:
    """r × (in + out) for every nn.Linear whose name ends in one of ``leaf_names`` (lm_head never); with ``experts``
    also r × n_experts × (in + out) for each fused expert tensor of shape [n_experts, out, in] (peft ParamWrapper)."""
    total = sum(
        r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in leaf_names
    )
    if experts:
        total += sum(
            r * p.shape[0] * (p.shape[1] + p.shape[2])
            for name, p in model.named_parameters()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        )
    return total


# ---------------------------------------------------------------- the spec


def test_parse_the_full_spec() -> None:
    spec = LoraSpec.parse("r=16,alpha=32,dropout=0.0,targets=q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")
    assert (spec.r, spec.lora_alpha, spec.dropout) == (16, 32.0, 0.0)
    assert spec.targets == ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def test_parse_defaults_and_spaces() -> None:
    spec = LoraSpec.parse("r=8")
    assert (spec.r, spec.lora_alpha, spec.dropout, spec.targets) == (8, 16.0, 0.0, ("attn",))
    assert LoraSpec.parse(" r = 4 , targets = attn , mlp ,dropout=0.1").targets == ("attn", "mlp")
    assert LoraSpec.parse("").r == 16
    assert LoraSpec.parse(spec.describe()) == LoraSpec(r=8, alpha=16.0, dropout=0.0, targets=("attn",))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rank=8", "unknown key 'rank'"),
        ("r=8,alpah=32", "did you mean 'alpha'?"),
        ("r=abc", "r must be an integer, got 'abc'"),
        ("r=1.5", "r must be an integer, got '1.5'"),
        ("r=", "r must be an integer, got ''"),
        ("r=0", "r must be a positive integer"),
        ("alpha=-1", "alpha must be positive"),
        ("dropout=1.5", "dropout must be in [0, 1)"),
        ("r=8,o_proj", "'o_proj' is not key=value"),
        ("r=8,r=4", "'r' given twice"),
        ("targets=", "targets= names nothing"),
    ],
)
def test_bad_specs_fail_with_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(UserError) as err:
        LoraSpec.parse(text)
    assert message in str(err.value) and "--lora" in err.value.where and err.value.fix


# ---------------------------------------------------------------- targets per architecture


def test_groups_resolve_per_architecture() -> None:
    v3, v2 = tiny(), tiny("tiny-deepseek-v2")
    attn_v3 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    mlp = ("gate_proj", "up_proj", "down_proj")
    assert resolve_targets(v3, LoraSpec.parse("targets=attn")) == Targets(attn_v3)
    assert resolve_targets(v2, LoraSpec.parse("r=8")).modules == ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    everything = resolve_targets(v3, LoraSpec.parse("targets=attn,mlp,experts"))
    assert everything == Targets((*attn_v3, *mlp), ("experts.gate_up_proj", "experts.down_proj"))
    # mlp = the dense MLP (layer 0) and the 3 shared experts, as nn.Linear: 4 × 3 layers
    assert len(Targets(mlp).wrapped_modules(v3)) == 12
    assert resolve_targets(v3, LoraSpec.parse("targets=self_attn.o_proj,o_proj")).modules == (
        "self_attn.o_proj",
        "o_proj",
    )
    llama_cfg = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
    )
    llama = AutoModelForCausalLM.from_config(llama_cfg)
    assert resolve_targets(llama, LoraSpec.parse("r=4")) == Targets(("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(UserError, match="this model has no fused routed experts"):
        resolve_targets(llama, LoraSpec.parse("targets=attn,experts"))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("q_proj", "'q_proj' matches no module (did you mean 'q_b_proj'?)"),
        ("wq", "'wq' matches no module"),
        ("gate_up_proj", "fused 3-D routed-expert parameter in transformers 5, not nn.Linear; use targets=experts"),
        ("mlp.experts", "fused 3-D parameters (not nn.Linear); use targets=experts"),
        ("gate", "'gate' is a DeepseekV3TopkRouter, not nn.Linear"),
    ],
)
def test_targets_that_wrap_no_linear_layer_are_rejected(target: str, message: str) -> None:
    with pytest.raises(UserError) as err:
        resolve_targets(tiny(), LoraSpec.parse(f"targets=o_proj,{target}"))
    assert message in str(err.value)
    assert "Linear layers here: down_proj, gate_proj, kv_a_proj_with_mqa" in err.value.fix
    assert "groups: attn, mlp, experts" in err.value.fix


def test_lm_head_and_the_router_are_refused_before_any_weight_loads() -> None:
    """lm_head (any model) when --lora is parsed; the MoE router 'gate' as soon as the config is read."""
    from deepzero.adapters.lora import check_moe_targets
    from deepzero.flops import routed_experts

    with pytest.raises(UserError, match="targets=lm_head: lm_head is not adapted"):
        LoraSpec.parse("targets=o_proj,lm_head")
    config = tiny().config
    with pytest.raises(UserError, match="'gate' is the deepseek_v3 router"):
        check_moe_targets(LoraSpec.parse("targets=o_proj,gate"), config, routed_experts(config))


def test_experts_take_no_dropout() -> None:
    with pytest.raises(UserError, match="cannot use dropout"):
        LoraSpec.parse("r=8,dropout=0.1,targets=attn,experts")


def test_peft_wraps_exactly_the_resolved_layers_and_merge_matches_the_adapters(tmp_path: Path) -> None:
    """One CPU process: dense and shared-expert Linears are wrapped (peft's v4 rewrite is off), the fused experts get
    ParamWrappers, only adapters train, and the merged export equals the unmerged adapters (fp32)."""
    spec = LoraSpec.parse(f"r={R},alpha=16,targets=attn,mlp,experts")
    model = apply_lora(tiny(), spec, verbose=False)
    summary = model._deepzero_lora
    assert (summary.wrapped_linear, summary.wrapped_experts) == (32, 6)  # 4 × 5 attention + 12 MLP; 3 MoE × 2
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if n.endswith(".lora_A")}
    assert "base_model.model.model.layers.0.mlp.gate_proj" in wrapped
    assert "base_model.model.model.layers.1.mlp.shared_experts.down_proj" in wrapped
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert all(is_adapter_param(n) for n in trainable)
    assert sum(trainable.values()) == expected_trainable(tiny(), ALL_LINEAR, R, experts=True) == summary.trainable
    with pytest.raises(RuntimeError, match="already carries peft adapters"):
        apply_lora(model, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    ids = torch.randint(0, 512, (2, 32))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert (expected - tiny()(input_ids=ids).logits).abs().max().item() > 1e-2  # the adapters do something
    merged = merged_model(model.state_dict(), model.peft_config["default"], model.get_base_model().config)
    merged.save_pretrained(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert set(reloaded.state_dict()) == set(tiny().state_dict())
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - expected).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------- 3 ranks of train.py

RUNS = {
    # ZeRO-2 preset as shipped, in fp16 on every CPU (native or faked: fp16_env); every Linear spelled out
    "zero2": ["--deepspeed_config", "ds_configs/zero2.json", "--lora", f"r={R},alpha=16,dropout=0.0,targets={','.join(ALL_LINEAR)}"],
    # ZeRO-3 (adapters added after zero.Init), groups incl. the fused routed experts, in fp32 so the merged export
    # must match the engine to rounding
    "zero3": ["--deepspeed_config", "ds_configs/zero3.json", "--precision", "fp32", "--lora", f"r={R},alpha=16,targets=attn,mlp,experts"],
}  # fmt: skip
WRAPPED = {"zero2": 32, "zero3": 32 + 6}  # Linear layers (+ fused expert tensors) that carry an adapter
EVAL_BATCHES = 2
TRAIN = [
    "--model", "tiny-deepseek-v3", "--max-steps", str(STEPS), "--lr", "1e-2", "--warmup-steps", "2",
    "--micro-batch", "2", "--grad-accum", "1", "--log-interval", "1",
    "--eval-interval", "1", "--eval-batches", str(EVAL_BATCHES),
    "--save-interval", "1", "--keep-last", str(STEPS),  # every step's checkpoint stays: step 1 and step STEPS compared
]  # fmt: skip
SUMMARY = re.compile(
    r"^lora: (?P<spec>\S+) \(scale 2\) on (?P<linear>\d+) Linear layers \[[^\]]*\]"
    r"(?: \+ (?P<experts>\d+) fused expert tensors)?; trainable (?P<trainable>[\d,]+) of (?P<total>[\d,]+) params",
    re.MULTILINE,
)
"""The line deepzero.adapters.lora.LoraSummary.describe prints on rank 0."""


def precision(name: str) -> str:
    return "fp16" if name == "zero2" else "fp32"


@pytest.fixture(scope="module", params=sorted(RUNS))
def lora_run(request: pytest.FixtureRequest, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """3 ranks of `train.py --lora ...` for STEPS steps: evaluated, logged and checkpointed every step."""
    out = tmp_path_factory.mktemp(f"lora_{request.param}") / "run"
    env = fp16_env() if precision(request.param) == "fp16" else None
    proc = launch([*RUNS[request.param], "--data", str(tiny_data), "--out", str(out), *TRAIN], env=env, timeout=600)
    return request.param, out, proc.stdout


def merged_checkpoint(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The ZeRO checkpoint of ``step`` as one state dict under the peft names, frozen base weights included."""
    return get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=tag_for(step))


@pytest.mark.launcher
def test_only_the_adapters_train(lora_run: tuple, tiny_data: Path) -> None:
    name, out, log = lora_run
    assert f"ZeRO-{name[-1]}  {precision(name)}" in log and "world 3 on cpu (gloo)" in log
    assert ("partitioned at load" in log) == (name == "zero3")  # ZeRO-3 split the base model while building it
    summary = SUMMARY.search(log)
    assert summary, log[-3000:]
    assert summary["spec"].startswith("r=8,alpha=16,dropout=0,")
    assert int(summary["linear"]) + int(summary["experts"] or 0) == WRAPPED[name]
    trainable, total = (int(summary[k].replace(",", "")) for k in ("trainable", "total"))
    expected = expected_trainable(tiny(), ALL_LINEAR, R, experts=name == "zero3")
    vocab = len(AutoTokenizer.from_pretrained(tiny_data / "tokenizer"))
    base = sum(p.numel() for p in tiny(vocab=vocab).parameters())
    assert trainable == expected and total - trainable == base

    # what the optimizer owns (ZeRO's param_shapes) and what it saved as frozen, from the rank-0 model states
    states = parse_model_states(get_model_state_files(str(out / "checkpoints" / tag_for(STEPS)))[:1])[0]
    owned = {n: s.numel() for group in states.param_shapes for n, s in group.items()}
    assert owned and all(is_adapter_param(n) for n in owned) and sum(owned.values()) == expected
    frozen = states.frozen_param_shapes or {}
    assert not any(is_adapter_param(n) for n in frozen) and sum(s.numel() for s in frozen.values()) == base

    before, after = merged_checkpoint(out, 1), merged_checkpoint(out, STEPS)
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    adapter = {k for k in before if is_adapter_param(k)}
    lora_b = {k for k in adapter if ".lora_B." in k}
    routing_bias = {k for k in before if k.endswith("e_score_correction_bias")}  # a buffer V3's balancing moves
    assert routing_bias and routing_bias <= changed, "the routing bias did not balance under LoRA"
    assert sorted(changed - adapter - routing_bias) == [], "frozen base weights moved"
    assert len(lora_b) == WRAPPED[name] and len(adapter) == 2 * WRAPPED[name]
    assert sorted(adapter - changed) == [], "adapter tensors that never trained"
    # WarmupLR climbs linearly from warmup_min_lr 0 and the lr logged at step 1 (the next step's) is still 0, so
    # update 1 had lr 0 too: the step-1 checkpoint holds the adapters as peft built them, every lora_B zero
    assert records(out)[0]["lr"] == 0.0
    assert all(not before[k].any() for k in lora_b), "lora_B did not start at zero"


@pytest.mark.launcher
def test_loss_falls(lora_run: tuple) -> None:
    _, out, _ = lora_run
    by_step = losses(out)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    curve = [by_step[s] for s in range(1, STEPS + 1)]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3, curve
    # held-out rows: evaluated after every step; after step 1 (lr 0, see above) the weights are still the initial ones
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == list(range(1, STEPS + 1))
    before, after = evals[0]["val_loss"], evals[-1]["val_loss"]
    assert after < before - 0.05, (before, after)


@pytest.mark.launcher
def test_merged_export_loads_without_peft_and_matches_the_engine(
    lora_run: tuple, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, out, _ = lora_run
    hf = out / "hf"
    (export,) = records(out, "export")
    assert export["ok"] and export["merged_modules"] == WRAPPED[name] and export["step"] == STEPS
    low = precision(name) == "fp16"
    assert export["dtype"] == ("float16" if low else "float32")
    # train.py compared the engine's logits with the reloaded export's on the first val row, token by token: every
    # token within the dtype's tolerance (deepzero.adapters.logit_check), every routing flip a near-tie
    assert export["tokens_compared"] > 0 and export["routing_flips"] == export["near_tie_flips"], export
    assert export["tokens_over_tolerance"] == export["exempt_tokens"] <= 1, export
    assert export["median_token_logit_diff"] <= export["p99_token_logit_diff"] <= export["max_abs_logit_diff"]
    if not low:  # fp32 engine and fp32 export: the same function up to summation order
        assert export["tolerance"] == 1e-4 and export["max_abs_logit_diff"] < 1e-4, export
    else:  # fp16: the merge rounds W + BA·α/r once; the engine adds B·A·x to W·x in fp16 (32 units of 2^-10)
        assert 0.03 <= export["tolerance"] < 0.2 and export["p99_token_logit_diff"] <= export["tolerance"], export
    assert sorted(p.name for p in hf.glob("*.safetensors")) == ["model.safetensors"]
    assert not (hf / "adapter_config.json").exists() and not list(hf.glob("*.bin"))

    for mod in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
        monkeypatch.setitem(sys.modules, mod, None)  # any `import peft` from here on raises ImportError
    monkeypatch.setitem(sys.modules, "peft", None)
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert set(model.state_dict()) == set(tiny().state_dict())  # original names: no base_layer, no lora_A/B

    # the reloaded model's mean loss on the val micro-batches of the final evaluation (deepzero.trainer.evaluate:
    # each rank's share of the first eval_batches × micro × world rows) equals the engine's val_loss at the last step
    config = json.loads((out / "run_config.json").read_text())
    micro, world = config["deepspeed"]["train_micro_batch_size_per_gpu"], int(config["env"]["WORLD_SIZE"])
    assert (micro, world, config["args"]["eval_batches"]) == (2, 3, EVAL_BATCHES)
    val = PackedDataset(tiny_data, "val")
    rows = min(EVAL_BATCHES * micro * world, len(val) // (micro * world) * (micro * world))
    model.eval()
    with torch.no_grad():
        batch_losses = [
            model(**batch).loss.float().item()
            for rank in range(world)
            for batch in make_eval_loader(val, micro, rank, world, max_rows=rows)
        ]
    final = records(out, "eval")[-1]
    assert final["step"] == STEPS and len(batch_losses) == EVAL_BATCHES * world
    mean = sum(batch_losses) / len(batch_losses)
    assert mean == pytest.approx(final["val_loss"], rel=1e-2 if low else 1e-4), (mean, final)


@pytest.mark.launcher
def test_the_offline_export_merges_a_lora_checkpoint_and_the_adapter_folder_names_full_paths(
    lora_run: tuple, tmp_path: Path
) -> None:
    """python -m deepzero.export of a LoRA checkpoint (peft's names): the adapters merged into the plain model's
    names, equal to the run's own export to the export dtype's rounding. The run wrote hf-adapter with every adapted
    module by its full path (not where fused expert tensors are adapted: full paths cannot name them)."""
    from deepzero.export import main

    name, out, _ = lora_run
    dtype = "fp16" if precision(name) == "fp16" else "fp32"
    assert main([str(out), "--out", str(tmp_path / "hf"), "--dtype", dtype]) == 0
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    theirs = load_file(out / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and not any(is_adapter_param(k) or "base_layer" in k for k in ours)
    for key, tensor in ours.items():
        scale = float(theirs[key].float().abs().max()) or 1.0
        atol = scale * (2**-10 if dtype == "fp16" else 1e-6)
        torch.testing.assert_close(tensor.float(), theirs[key].float(), rtol=0, atol=atol, msg=key)
    (export,) = records(out, "export")
    if name == "zero3":  # targets=experts: fused 3-D adapters
        assert export["adapter_path"] == "" and not (out / "hf-adapter").exists()
        return
    assert export["adapter_path"] == str(out / "hf-adapter")
    folder = json.loads((out / "hf-adapter" / "adapter_config.json").read_text())
    wrapped = [n for n, _ in tiny().named_modules() if n.rsplit(".", 1)[-1] in ALL_LINEAR]
    assert sorted(folder["target_modules"]) == sorted(wrapped) and len(wrapped) == WRAPPED[name]


def test_a_resume_with_other_adapters_or_another_base_is_one_line_naming_the_key(tmp_path) -> None:
    """--resume reads the run's run_config.json before any weight loads: another LoRA rank, alpha, dropout or targets
    (or LoRA added or dropped, or another 4-bit choice) would load a checkpoint of another model."""
    import json

    from deepzero.adapters.lora import check_same_adapters
    from deepzero.errors import UserError

    first = tmp_path / "run_config.json"
    first.write_text(json.dumps({"args": {"lora": "r=8,alpha=16,targets=attn", "load_in_4bit": True}}))
    check_same_adapters(first, "r=8,alpha=16,targets=attn", True)  # the same: accepted
    check_same_adapters(first, "r=8,targets=attn", None)  # alpha's default is 2 × r; 4-bit deferred to the preset
    for lora, four_bit, line in [
        ("r=8,alpha=64,targets=attn", True, "--lora alpha was 16.0, now 64.0"),
        ("r=4,alpha=16,targets=attn", True, "--lora r was 8, now 4"),
        ("r=8,alpha=16,targets=attn,mlp", True, "--lora targets was ('attn',), now ('attn', 'mlp')"),
        ("r=8,alpha=16,dropout=0.1,targets=attn", True, "--lora dropout was 0.0, now 0.1"),
        (None, True, "the run trained LoRA adapters, this launch asks no --lora"),
        ("r=8,alpha=16,targets=attn", False, "load_in_4bit was True, now False"),
    ]:
        with pytest.raises(UserError, match=re.escape(line)) as err:
            check_same_adapters(first, lora, four_bit)
        assert str(err.value).startswith(f"--resume ({first})") and "Fix: " in str(err.value)
    check_same_adapters(tmp_path / "missing.json", "r=4", None)  # no run_config yet: nothing to compare


def test_half_of_the_fused_gate_up_pair_on_a_moe_is_one_line_before_loading(tiny_data: Path, tmp_path: Path) -> None:
    """targets=q_proj,up_proj on a DeepSeek MoE would train and then fail peft's export: refused by train.py before
    any weight loads (the model path is a config only: loading weights would fail first)."""
    import subprocess
    import sys

    from deepzero.adapters.lora import check_moe_targets
    from deepzero.flops import routed_experts
    from tests.conftest import REPO, cpu_env

    config = tiny().config
    with pytest.raises(UserError, match=r"names up_proj without gate_proj: on a deepseek_v3 model peft exports"):
        check_moe_targets(LoraSpec.parse("targets=q_b_proj,up_proj"), config, routed_experts(config))
    check_moe_targets(LoraSpec.parse("targets=gate_proj,up_proj"), config, routed_experts(config))  # the pair: fine
    config.save_pretrained(tmp_path / "config-only")  # no weights at all
    cmd = [
        sys.executable,
        "train.py",
        "--deepspeed_config",
        "ds_configs/zero2.json",
        "--model",
        str(tmp_path / "config-only"),
    ]
    cmd += ["--lora", "targets=o_proj,up_proj", "--data", str(tiny_data), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--lora targets=o_proj,up_proj: names up_proj without gate_proj" in errors[0]


def test_a_saved_v3_folders_balancing_moves_the_bias_into_hf_and_the_adapter_folder(
    tiny_data: Path, tmp_path: Path
) -> None:
    """A DeepSeek-V3 folder saved by Transformers (not the preset), LoRA, bias rate 0.05, 3 steps: the routing bias
    moves, reaches hf/, and hf-adapter/ carries the routers as peft modules_to_save, so stock peft on the base gives
    hf/'s logits (before, the adapter folder lacked the bias: the base's routing). An odd step count: a rate far
    above the spread of a random router's scores makes each bias flip sign every step (+0.05, 0, +0.05, 0), so at
    steps 4 and 8 it is exactly 0 again, which had looked like balancing that never moves."""
    import subprocess
    import sys

    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.conftest import REPO, cpu_env

    tiny().save_pretrained(tmp_path / "v3")
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--deepspeed_config", "ds_configs/zero2.json", "--ds", "train_batch_size=auto"]
    cmd += ["--model", str(tmp_path / "v3"), "--data", str(tiny_data), "--out", str(out), "--max-steps", "3"]
    cmd += ["--moe-bias-rate", "0.05", "--lora", "r=4", "--precision", "fp32", "--eval-interval", "0"]
    cmd += ["--save-interval", "0", "--log-interval", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a base with files is exported as QLoRA's is (deepzero.adapters.exporters): the adapters and the trained bias
    # merged into the folder's own file, shard by shard, checked against it and round-tripped through stock peft
    # (the in-memory merge of the engine's whole model, which this run used before, records none of this)
    (export,) = records(out, "export")
    assert export["ok"] and export["largest_shard_bytes"] == (tmp_path / "v3" / "model.safetensors").stat().st_size
    saved_biases = [
        k for k in load_file(tmp_path / "v3" / "model.safetensors") if k.endswith("e_score_correction_bias")
    ]
    assert export["merged_tensors"] >= export["moved_tensors"] > 0 and export["trained_buffers"] == len(saved_biases)
    assert export["logit_check"].startswith("merged folder vs the source") and export["max_abs_logit_diff"] is not None
    assert export["peak_host_bytes"] > 0 and export["adapter_path"] == str(out / "hf-adapter"), export
    merged = load_file(out / "hf" / "model.safetensors")
    biases = {k: v for k, v in merged.items() if k.endswith("e_score_correction_bias")}
    assert biases and all(v.abs().max() > 0 for v in biases.values())  # moved from the saved zeros
    adapter = load_file(out / "hf-adapter" / "adapter_model.safetensors")
    for name, bias in biases.items():
        assert torch.equal(adapter[f"base_model.model.{name}"], bias)
    x = torch.randint(0, 500, (2, 16))
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "v3"), out / "hf-adapter")
    with torch.no_grad():
        gap = (stock.eval()(x).logits - AutoModelForCausalLM.from_pretrained(out / "hf").eval()(x).logits).abs()
    assert gap.max() < 1e-4 and gap.flatten().quantile(0.99) < 1e-4
