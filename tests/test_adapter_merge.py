"""The export of adapters over a 16-bit base, shard by shard (deepzero.adapters.merge), in process: its host memory
on a base many shards large, a deliberately unmerged export caught by its check, the round trip a user makes with
stock peft per architecture (Llama, Qwen2, DeepSeek-V2, DeepSeek-V3), and a tokenizer larger than the base's
vocabulary. The 3-rank QLoRA runs that call it: tests/test_qlora.py."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from test_qlora import ARCH  # the tiny dense architecture the QLoRA runs use
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from deepzero.adapters import merge
from deepzero.adapters.lora import LoraSpec, apply_lora
from deepzero.adapters.merge import load_adapter
from deepzero.presets import get_preset

R = 4
PROBE = torch.tensor([[1, 5, 9, 200, 3, 77, 41, 8]])
ARCHS = {
    "llama": lambda: LlamaConfig(**ARCH),
    "qwen2": lambda: Qwen2Config(**ARCH),
    "deepseek_v2": lambda: get_preset("tiny-deepseek-v2").config(vocab_size=512),
    "deepseek_v3": lambda: get_preset("tiny-deepseek-v3").config(vocab_size=512),
}


def saved_base(folder: Path, config: object, shard: str = "5GB") -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def trained_adapters(base: Path, targets: str) -> tuple[torch.nn.Module, merge.Adapters]:
    """The base with LoRA adapters as apply_lora wraps them, every B drawn at random (as if trained)."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), LoraSpec.parse(targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)
    state = {n: p for n, p in model.named_parameters() if p.requires_grad}
    config = model.peft_config["default"]
    return model.eval(), merge.Adapters.from_state(state, config.r, config.lora_alpha)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_adapter_folder_round_trips_through_peft_per_architecture(arch: str, tmp_path: Path) -> None:
    """attn + mlp adapters (DeepSeek: the dense layer's MLP and the shared experts too): the merged folder gives the
    trained peft model's logits, and so does the source with hf-adapter applied unmerged. On DeepSeek, stock peft
    0.21.2 rewrites gate/up/down_proj targets to the fused experts (huggingface/peft#3711) and the record says so;
    load_adapter then gives the trained model."""
    base = saved_base(tmp_path / "base", ARCHS[arch]())
    model, adapters = trained_adapters(base, f"r={R},targets=attn,mlp")
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", PROBE)
    assert report.ok and report.merged_tensors == report.moved_tensors == len(adapters.pairs), report
    assert report.median_token_logit_diff is not None and "unmerged" in report.logit_check
    with torch.no_grad():
        trained = model(input_ids=PROBE).logits.float()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")(input_ids=PROBE).logits.float()
        with model.disable_adapter():
            untouched = model(input_ids=PROBE).logits.float()
    effect = (trained - untouched).abs().amax(-1).median().item()
    gap = (merged - trained).abs().amax(-1).median().item()
    assert gap <= report.tolerance < effect, (gap, effect)  # the adapters matter far beyond the tolerance
    folder = json.loads((tmp_path / "hf-adapter" / "adapter_config.json").read_text())
    assert sorted(folder["target_modules"]) == sorted(adapters.pairs)
    moe = arch.startswith("deepseek")
    if moe:
        assert any(".shared_experts." in m for m in adapters.pairs) and any(
            ".mlp.gate_proj" in m for m in adapters.pairs
        )
        loaded = load_adapter(AutoModelForCausalLM.from_pretrained(base, dtype="auto"), tmp_path / "hf-adapter")
        with torch.no_grad():
            again = loaded.eval()(input_ids=PROBE).logits.float()
        assert (again - trained).abs().amax(-1).median().item() <= report.tolerance
    if moe and peft.__version__ == "0.21.2":
        assert "huggingface/peft#3711" in report.peft and "load_adapter" in report.peft, report.peft
    else:
        assert report.peft == f"stock peft {peft.__version__} loads it as trained", report.peft


def test_an_unmerged_export_is_caught_and_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = saved_base(tmp_path / "base", ARCHS["llama"]())
    _, adapters = trained_adapters(base, f"r={R},targets=attn")
    monkeypatch.setattr(merge.Adapters, "merged", lambda self, module, weight: weight)  # the merge forgotten
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", PROBE)
    assert not report.ok and report.problems and "is not W + (alpha/r)·B·A" in report.problems[0]
    assert "\n" not in report.why and report.why.startswith("the merged files are not the base plus the adapters")
    assert not (tmp_path / "hf").exists() and (tmp_path / "hf.partial" / "config.json").is_file()


def test_host_memory_stays_near_one_shard_on_a_base_many_shards_large(tmp_path: Path) -> None:
    """A ~440 MB bf16 Llama in 32 MB shards (14 of them): the export's peak resident memory above its start stays
    within a few shards plus the adapters, never near the base (the whole-model merge held it twice)."""
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    base = saved_base(tmp_path / "base", config, shard="32MB")
    torch.manual_seed(0)
    pairs = {}
    for layer in range(16):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs[f"model.layers.{layer}.self_attn.{proj}"] = (torch.randn(16, 1024) * 0.01, torch.randn(1024, 16))
    adapters = merge.Adapters(pairs, r=16, alpha=32.0)
    adapter_bytes = sum(4 * (a.numel() + b.numel()) for a, b in pairs.values())
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", PROBE, logit_check_bytes=0)
    assert report.ok and report.merged_tensors == report.moved_tensors == 64, report
    assert report.base_bytes > 400e6 and report.base_bytes > 12 * report.largest_shard_bytes
    bound = 5 * report.largest_shard_bytes + adapter_bytes  # measured: about 3 (input mapped, output, its write)
    assert report.peak_host_bytes <= bound, (report.peak_host_bytes, bound, report.base_bytes)
    index = json.loads((tmp_path / "hf" / merge.INDEX_FILE).read_text())
    assert index == json.loads((base / merge.INDEX_FILE).read_text())  # the same shards, names and total size
    assert report.logit_check.startswith("skipped")


def test_a_tokenizer_larger_than_the_base_vocabulary(tmp_path: Path) -> None:
    """Tokens added beyond the base's vocabulary (the trainer enlarged its embedding for them): the export keeps the
    base's vocabulary, saves the whole tokenizer, and compares logits on the ids the base has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(600)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0")
    base = saved_base(tmp_path / "base", ARCHS["qwen2"]())
    _, adapters = trained_adapters(base, f"r={R},targets=attn")
    probe = torch.tensor([[3, 7, 550, 9, 599, 11]])  # 550 and 599 are beyond the base's 512
    report = merge.export_merged(str(base), adapters, tokenizer, tmp_path / "hf", probe)
    assert report.ok and report.median_token_logit_diff is not None, report
    assert len(PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")) == 600
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 512


def test_buffers_the_run_trained_are_exported_as_trained(tmp_path: Path) -> None:
    """V3's routing bias moves during training (the balancing), and QLoRA's checkpoint and engine hold it: the
    export writes the trained bias, not the source's, and its check compares with the trained one."""
    base = saved_base(tmp_path / "base", ARCHS["deepseek_v3"]())
    _, adapters = trained_adapters(base, f"r={R},targets=attn")
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    source = load_file(base / "model.safetensors")[key]
    trained = {key: source.float() + torch.linspace(-0.5, 0.5, source.numel())}
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", PROBE, trained=trained)
    assert report.ok and report.trained_buffers == 1, report
    exported = load_file(tmp_path / "hf" / "model.safetensors")[key]
    assert torch.equal(exported, trained[key].to(source.dtype)) and not torch.equal(exported, source)
