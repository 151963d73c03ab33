"""The export of adapters over a 16-bit base, shard by shard (deepzero.adapters.merge), in process: its host memory
on a base many shards large, a deliberately unmerged export caught by its check, the round trip a user makes with
stock peft per architecture (Llama, Qwen2, DeepSeek-V2, DeepSeek-V3), and a tokenizer larger than the base's
vocabulary. The 3-rank QLoRA runs that call it: tests/test_qlora.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from test_qlora import ARCH  # the tiny dense architecture the QLoRA runs use
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, LlamaConfig, Qwen2Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from deepzero.adapters import logit_check, merge
from deepzero.adapters.lora import LoraSpec, apply_lora
from deepzero.adapters.peft_compat import load_adapter
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
    assert report.max_abs_logit_diff <= report.tolerance and "unmerged" in report.logit_check
    assert report.routing_flips == report.near_tie_flips and report.tokens_compared == PROBE.numel()
    with torch.no_grad():
        trained = model(input_ids=PROBE).logits.float()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")(input_ids=PROBE).logits.float()
        with model.disable_adapter():
            untouched = model(input_ids=PROBE).logits.float()
    effect = (trained - untouched).abs().amax(-1).median().item()
    gap = (merged - trained).abs().amax(-1).max().item()
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
        assert (again - trained).abs().amax(-1).max().item() <= report.tolerance
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
    assert report.ok and report.tokens_compared == 4, report
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


LONG_PROBE = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
"""128 tokens: enough for a 99th percentile that is not the maximum."""


def v3_with_moved_routing_bias(tmp_path: Path) -> tuple[Path, merge.Adapters, dict[str, torch.Tensor]]:
    """A tiny DeepSeek-V3 in bf16, attn + mlp adapters, and every router's bias moved as balancing moves it."""
    base = saved_base(tmp_path / "base", ARCHS["deepseek_v3"]())
    _, adapters = trained_adapters(base, f"r={R},targets=attn,mlp")
    source = load_file(base / "model.safetensors")
    biases = [k for k in source if k.endswith(merge.ROUTING_BIAS)]
    return base, adapters, {k: source[k].float() + torch.linspace(-0.5, 0.5, source[k].numel()) for k in biases}


def test_a_v3_adapter_with_a_moved_routing_bias_round_trips_token_by_token(tmp_path: Path) -> None:
    """The folder (routers as modules_to_save) on the base gives the merged folder's logits on every token: max and
    p99 of the per-token max |Δlogit| within the bf16 tolerance, every token's experts the same. Measured here: max
    0.061, p99 0.049, median 0.011 against a tolerance of 0.25 (32 units of 2^-7 at the logits' scale)."""
    base, adapters, trained = v3_with_moved_routing_bias(tmp_path)
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", LONG_PROBE, trained=trained)
    assert report.ok and report.trained_buffers == len(trained) == 3, report
    assert report.tolerance == logit_check.ULPS * 2**-7  # the logits' scale is below 1 here
    assert report.max_abs_logit_diff <= report.tolerance and report.p99_token_logit_diff <= report.tolerance
    assert report.median_token_logit_diff <= report.p99_token_logit_diff <= report.max_abs_logit_diff
    assert (report.tokens_compared, report.tokens_over_tolerance, report.routing_flips) == (128, 0, 0), report


def test_a_broken_v3_adapter_folder_fails_the_round_trip_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two broken adapter folders beside a right merged folder. The routing bias left out (the folder before the
    routers were saved): the logits barely move (the tiny model's routed experts add little: max 0.076, p99 0.046),
    but every token chose other experts with the routers' logits equal, which no near-tie explains. One lora_B
    doubled: 73 of 128 tokens over the tolerance (max 0.91, p99 0.84, median 0.30)."""
    base, adapters, trained = v3_with_moved_routing_bias(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(merge.Adapters, "with_routers", lambda self, trained, weight: self)
        report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", LONG_PROBE, trained=trained)
    assert not report.ok and report.max_abs_logit_diff <= report.tolerance, report
    assert report.routing_flips == report.tokens_compared == 128 and report.near_tie_flips == 0, report
    assert "\n" not in report.why and "128 of 128 tokens chose other experts, not on a near-tie" in report.why

    peft_state = merge.Adapters.peft_state

    def one_b_doubled(self: merge.Adapters) -> dict[str, torch.Tensor]:
        state = peft_state(self)
        key = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
        return state | {key: 2 * state[key]}

    monkeypatch.setattr(merge.Adapters, "peft_state", one_b_doubled)
    report = merge.export_merged(str(base), adapters, None, tmp_path / "hf", LONG_PROBE, trained=trained)
    assert not report.ok and not report.problems, report  # the merged files are right: only the folder is wrong
    assert report.p99_token_logit_diff > 2 * report.tolerance and report.tokens_over_tolerance > 64, report
    assert "\n" not in report.why and report.why.startswith(
        "the merged folder's logits differ from the base with the adapter folder unmerged: "
    )
    assert f"tokens over tolerance {report.tolerance:.3g} (bfloat16)" in report.why and "p99" in report.why


def deep_routes(flip: torch.Tensor, other_flip: torch.Tensor, chosen: list[int], **other: object) -> tuple:
    """Three routers of a V3-style model (4 experts, top 2, routing bias) over two tokens, in a reference forward and
    another: the first two routers agree; at the third, token 0 has logits ``flip`` in the reference (which chose
    experts 0 and 1) and ``other_flip`` in the other forward, which chose ``chosen``; token 1 agrees throughout.
    ``other``: fields of the other forward's third call to replace (its bias, its weight)."""
    bias, weight = torch.tensor([0.0, 0.1, 0.1, 0.0]), torch.linspace(-1, 1, 4 * 6).view(4, 6)
    calm = torch.tensor([[0.6, -0.2, 0.1, 0.9], [0.5, 0.4, -0.3, 0.0]])
    same = logit_check.Route(calm, torch.tensor([[0, 3], [0, 1]]), bias, weight)
    ref = [same, same, logit_check.Route(torch.stack([flip, calm[1]]), torch.tensor([[0, 1], [0, 1]]), bias, weight)]
    last = logit_check.Route(torch.stack([other_flip, calm[1]]), torch.tensor([chosen, [0, 1]]), bias, weight)
    return ref, [same, same, dataclasses.replace(last, **other)]


def test_a_deep_near_tie_is_judged_by_its_own_perturbation_not_a_fixed_bound() -> None:
    """At a deep router the hidden states' rounding may move the logits by more than any fixed bound (here by 200
    units of bf16's precision, where the old rule allowed 32): a flip between two experts whose scores lie within
    that change is still a near-tie. A flip whose swapped experts lie 10× further apart than the scores moved is
    not (a choice the change cannot explain), nor a flip with another routing bias or another router weight."""
    unit = torch.finfo(torch.bfloat16).eps  # the logits' scale is below 1: one unit is eps
    ref_logits = torch.tensor([1.0, 0.3, 0.25, -1.0])
    moved = ref_logits + torch.tensor([0.0, -200.0, 200.0, 0.0]) * unit  # expert 2 overtakes expert 1
    assert (moved - ref_logits).abs().max() == 200 * unit > logit_check.ULPS * unit
    ref, other = deep_routes(ref_logits, moved, [0, 2])
    flipped, ties = logit_check.routing_flips(ref, other, torch.bfloat16)
    assert flipped.tolist() == [True, False] and ties.tolist() == [True, False]

    far = torch.tensor([1.0, 0.3, -0.5, -1.0])  # expert 2 far below expert 1, the scores barely moved
    ref, other = deep_routes(far, far + torch.tensor([0.0, -0.04, 0.04, 0.0]), [0, 2])
    scores = [logit_check.selection_scores(r[2])[0] for r in (ref, other)]
    change, margin = (scores[0] - scores[1]).abs().max(), scores[0][1] - scores[0][2]
    assert margin >= 10 * change, (margin, change)
    flipped, ties = logit_check.routing_flips(ref, other, torch.bfloat16)
    assert flipped.tolist() == [True, False] and ties.tolist() == [False, False]

    for change_of in ({"bias": torch.tensor([0.0, 0.1, 0.4, 0.0])}, {"bias": None}, {"weight": torch.zeros(4, 6)}):
        ref, other = deep_routes(ref_logits, moved, [0, 2], **change_of)
        flipped, ties = logit_check.routing_flips(ref, other, torch.bfloat16)
        assert flipped.tolist() == [True, False] and ties.tolist() == [False, False], change_of
    ref, other = deep_routes(ref_logits, moved, [0, 2], weight=None)  # not recorded whole (ZeRO-3): not compared
    assert logit_check.routing_flips(ref, other, torch.bfloat16)[1].tolist() == [True, False]


def test_a_flip_between_expert_groups_is_judged_on_the_groups() -> None:
    """A group-limited router (V3: the best groups by their top-2 scores, then the top-k in them) may choose an
    expert scoring below one it passed over: a near-tie of two groups' scores swaps experts that lie far apart, so
    per-expert scores cannot judge that flip (its weights and biases still are). The recorder knows the groups from
    Transformers' routers: V3 limits its choice, V2's greedy one does not."""
    ref_logits, moved = torch.tensor([[1.0, -3.0, -0.48, -0.48]]), torch.tensor([[1.0, -3.0, -0.44, -0.44]])
    ref = [logit_check.Route(ref_logits, torch.tensor([[0]]), torch.zeros(4), groups=2)]
    other = [logit_check.Route(moved, torch.tensor([[2]]), torch.zeros(4), groups=2)]
    assert logit_check.routing_flips(ref, other, torch.bfloat16)[1].tolist() == [True]
    ungrouped = [dataclasses.replace(r, groups=1) for r in (*ref, *other)]
    assert logit_check.routing_flips(ungrouped[:1], ungrouped[1:], torch.bfloat16)[1].tolist() == [False]

    shape = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4}
    groups = {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 1}
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(**shape, **groups))
    v2 = DeepseekV2TopkRouter(DeepseekV2Config(**shape, **groups, topk_method="greedy"))
    with logit_check.routing_recorded() as calls:
        v3(torch.randn(5, 8))
        v2(torch.randn(5, 8))
    assert [(c.groups, c.bias is None, tuple(c.weight.shape)) for c in calls] == [(2, False, (4, 8)), (1, True, (4, 8))]


def test_near_tie_flips_are_told_from_other_routing() -> None:
    """The judgment on recorded router calls: a token whose experts differ on a near-tie that the routers' change
    explains is a near-tie flip (exempt from the tolerance); a flip with
    another routing bias is not, nor one whose swapped experts lie far further apart than the scores moved."""
    logits = torch.tensor([[0.30, 0.2999, 0.1], [0.5, 0.1, 0.0], [0.2, 0.4, 0.1]])
    ref = [logit_check.Route(logits, torch.tensor([[0], [0], [1]]), torch.zeros(3))]
    other = [logit_check.Route(logits + 1e-3, torch.tensor([[1], [0], [1]]), torch.zeros(3))]
    flipped, ties = logit_check.routing_flips(ref, other, torch.bfloat16)
    assert flipped.tolist() == [True, False, False] and ties.tolist() == [True, False, False]
    wide = [logit_check.Route(logits + 1e-3, torch.tensor([[0], [1], [1]]), torch.zeros(3))]  # 0.5 vs 0.1
    flips = logit_check.routing_flips(ref, wide, torch.bfloat16)
    assert flips[0].tolist() == [False, True, False] and flips[1].tolist() == [False, False, False]
    biased = [logit_check.Route(logits, torch.tensor([[1], [0], [1]]), torch.tensor([0.0, 0.3, 0.0]))]
    assert logit_check.routing_flips(ref, biased, torch.bfloat16)[1].tolist() == [False, False, False]
    diff = torch.zeros(1, 3, 5)
    diff[0, 0, 2] = 1.0  # the flipped token differs by far more than the tolerance
    gaps = logit_check.token_gaps(diff, 0.25, (flipped, ties))
    assert (gaps["tokens_over_tolerance"], gaps["exempt_tokens"], gaps["max_abs_logit_diff"]) == (1, 1, 1.0)
