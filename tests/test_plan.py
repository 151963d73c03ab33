"""The memory planner: ZeRO-paper model states, DeepSpeed's estimators, activations, the CLI, and (launcher)
the per-rank bytes a real 3-rank DeepSpeed engine holds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NATIVE_16BIT, REPO, cpu_env, launch

from deepzero import dsconfig, engines, modeling, plan
from deepzero.adapters import quant
from deepzero.adapters.lora import LoraSpec
from deepzero.args import parse_args
from deepzero.errors import UserError
from deepzero.modeling import planning_config
from deepzero.plan import GiB, Setup, ZeroKnobs, estimate, model_stats, rank_states
from deepzero.presets import PRESETS, get_preset
from deepzero.tiled_loss import TiledLoss, vocab_block

N = 3


@pytest.fixture(scope="module")
def coder() -> plan.ModelStats:
    return model_stats(PRESETS["deepseek-coder-1.3b"].config(), "deepseek-coder-1.3b")


@pytest.fixture(scope="module")
def tiny() -> plan.ModelStats:
    return model_stats(get_preset("tiny-deepseek-v3").config(), "tiny-deepseek-v3")


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel)


# ------------------------------------------------------------------------------------- parameter counts


def test_counts_dense_and_moe(coder: plan.ModelStats, tiny: plan.ModelStats) -> None:
    assert coder.total == 1_346_471_936
    assert coder.active == coder.total and coder.routed_experts == 0
    assert coder.embedding == 2 * 32256 * 2048
    # tiny V3: 3 MoE layers × 8 experts × (gate_up 192×128 + down 128×96); top-2 of 8 are active
    routed = 3 * 8 * (192 * 128 + 128 * 96)
    assert tiny.routed_experts == routed
    assert tiny.active == tiny.total - routed + routed * 2 // 8
    assert tiny.largest_module == 4096 * 128  # embedding (one layer's packed experts hold 8 × 36864)


# -------------------------------------------------------------------------------------- ZeRO layout


def test_stage2_layout_pads_to_2n_and_gradients_cover_straddling_params() -> None:
    setup = Setup(stage=2, world_size=3)
    ranks = rank_states([5, 7], [], setup)  # flat 12 (multiple of 6), partitions [0,4) [4,8) [8,12)
    assert [r.optimizer for r in ranks] == [4, 4, 4]
    assert [r.grads for r in ranks] == [5, 12, 7]
    assert all(r.params == 12 for r in ranks)
    assert rank_states([5], [], setup)[0].params == 6  # 5 padded to 6


def test_stage3_layout_shards_each_param_and_keeps_small_ones_whole() -> None:
    setup = Setup(stage=3, world_size=3, zero=ZeroKnobs(param_persistence_threshold=100))
    r = rank_states([10, 200_000], [], setup)[0]
    assert r.optimizer == r.grads == 4 + 66_667
    assert r.persistent == 12  # 10 rounded up to a multiple of 3, full copy on every rank
    assert r.params == 4 + 66_667 + 12


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_the_zero_paper(coder: plan.ModelStats, stage: int) -> None:
    """Rajbhandari et al. 2020, mixed-precision Adam: 2Ψ + 2Ψ + KΨ with K = 12, partitioned per stage."""
    psi, k = coder.total, 12
    paper = {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / N, 2: 2 * psi + (2 + k) * psi / N, 3: (2 + 2 + k) * psi / N}
    e = estimate(coder, Setup(stage=stage, world_size=N))
    # stage 2's gradient buffer also holds the parts of params straddling the partition edge (<1% here)
    assert close(e.params + e.grads + e.optimizer, paper[stage], 0.01)


def test_offload_moves_optimizer_and_params_to_host(coder: plan.ModelStats) -> None:
    psi = coder.total
    z2 = estimate(coder, Setup(stage=2, world_size=N, offload_optimizer=True))
    assert z2.optimizer == z2.grads == z2.step == 0
    assert close(z2.host_states, 18 * psi, 1e-6)  # fp32 master + m + v + fp32 grads + 16-bit staging
    z3 = estimate(coder, Setup(stage=3, world_size=N, offload_optimizer=True, offload_params=True))
    assert z3.params < 0.001 * psi  # only persistent norms stay on the card
    assert close(z3.host_states, 20 * psi, 1e-3)


def test_lora_only_adapters_get_gradients_and_optimizer(coder: plan.ModelStats) -> None:
    h, i, layers, r = 2048, 5504, 24, 16
    adapters = r * layers * (4 * (h + h) + 2 * (h + i) + (i + h))  # q k v o, gate up, down
    e = estimate(coder, Setup(stage=2, world_size=N, lora_rank=r))
    assert e.trainable == adapters
    assert close(e.optimizer, 12 * adapters / N, 1e-4)
    assert close(e.params, 2 * (coder.total + adapters), 1e-6)  # frozen base stays whole under ZeRO-2
    z3 = estimate(coder, Setup(stage=3, world_size=N, lora_rank=r))
    # ZeRO-3 shards the frozen base too; adapters (< 1e5 elements each) are also kept whole as persistent params
    assert close(z3.params, 2 * coder.total / N + 2 * adapters * (1 + 1 / N), 0.001)


def test_a_4bit_base_holds_its_linears_as_nf4_codes_and_the_rest_in_16_bits(coder: plan.ModelStats) -> None:
    """QLoRA (issue 32): every nn.Linear but the LM head is 4 bits + its constants, the rest 16-bit; ZeRO-3 shards
    the codes like any parameter, the constants stay whole. Under ZeRO-2 every card first loads the whole 4-bit base;
    under ZeRO-3 the ranks load it on the host in turn and each card holds its partition plus one whole tensor."""
    h, i, layers, r = 2048, 5504, 24, 16
    linears = layers * (4 * h * h + 3 * h * i)
    assert sum(coder.four_bit_numels()) == linears and len(coder.four_bit_numels()) == 7 * layers
    floats = coder.total - linears  # embedding, head, norms
    adapters = sum(coder.lora_numels(r))
    constants = sum(map(quant.quant_state_bytes, coder.four_bit_numels()))
    assert close(constants, linears / 64 + 4 * linears / 64 / 256 + 7 * layers * quant.CONSTANT_BYTES, 1e-3)
    z2 = estimate(coder, Setup(stage=2, world_size=N, lora_rank=r, four_bit=True))
    assert z2.trainable == adapters and close(z2.optimizer, 12 * adapters / N, 1e-4)
    assert close(z2.params, linears / 2 + constants + 2 * (floats + adapters), 1e-6)
    z3 = estimate(coder, Setup(stage=3, world_size=N, lora_rank=r, four_bit=True))
    assert close(z3.params, (linears / 2 + 2 * floats) / N + constants + 2 * adapters * (1 + 1 / N), 1e-3)
    whole = linears / 2 + constants + 2 * floats + 4 * adapters
    assert z2.load == whole > z2.params and z2.allocated >= z2.load
    largest = 2 * coder.param_numels[0]  # the embedding, in 16 bits: the largest tensor moved whole to a card
    assert close(z3.load, (linears / 2 + 2 * floats) / N + constants + 4 * adapters + largest, 1e-6)
    assert z3.load < z2.load and z3.allocated >= z3.load
    quantising = (2 + quant.QUANTISE_BYTES) * 2048 * 5504  # an MLP weight read in 16 bits and being quantised
    assert close(z3.host_load, whole - 4 * adapters + max(largest, quantising), 1e-6)  # one whole base at a time
    assert estimate(coder, Setup(stage=3, world_size=N, lora_rank=r)).load == 0
    with pytest.raises(UserError, match="a 4-bit base needs LoRA"):
        Setup(stage=2, world_size=N, four_bit=True)


def test_qlora_fits_32b_and_70b_on_24gb_cards_and_v2_lite_with_its_experts_on_zero2() -> None:
    """3 × 24 GiB at 2,048 tokens. R1-Distill-Qwen-32B: 16-bit LoRA needs ZeRO-3 with parameter offload, QLoRA fits
    ZeRO-3 on the cards. R1-Distill-Llama-70B: its 4-bit base (37.6 GiB) never sits whole on a card (the ranks load it
    on the host in turn, each keeping its ZeRO-3 partition), and it fits with the checkpointed activations offloaded,
    which the planner tries only after every preset failed with train.py's defaults. V2-Lite: its fused routed experts
    are quantised too (``quant.quantise_experts``), so its whole 4-bit base (8 GiB) sits on each card under ZeRO-2,
    where 16-bit LoRA needs ZeRO-3; the ranks load it on the host in turns, its experts 16-bit until quantised."""
    gpu, cpu = 24 * GiB, 128 * GiB
    for name in ("deepseek-r1-distill-qwen-32b", "deepseek-r1-distill-llama-70b"):
        stats = model_stats(PRESETS[name].config(), name)
        lora = plan.recommend(stats, N, 2048, gpu, cpu, lora_rank=16)
        qlora = plan.recommend(stats, N, 2048, gpu, cpu, lora_rank=16, four_bit=True)
        assert qlora is not None and qlora.preset == "zero3" and qlora.setup.four_bit, name
        assert qlora.estimate.gpu_total <= gpu and qlora.estimate.load < qlora.estimate.allocated
        whole = plan.four_bit_base_bytes(stats, qlora.setup)
        assert qlora.estimate.load < whole / 2 and qlora.estimate.host_load > whole  # one whole base, on the host
        if name.endswith("32b"):
            assert lora is not None and lora.preset == "zero3_offload" and not qlora.setup.savers.offload
        else:
            assert lora is None and qlora.setup.savers.offload and qlora.setup.checkpointing
            defaults = replace(qlora.setup, micro_batch=1, savers=plan.SaverTerms.choose(stats.arch))
            assert estimate(stats, defaults).gpu_total > gpu
            # the CLI and train.py's start-of-run check pass the run's savers: the same last resort
            savers = plan.SaverTerms.choose(stats.arch)
            assert plan.recommend(stats, N, 2048, gpu, cpu, lora_rank=16, four_bit=True, savers=savers) == qlora
    v2 = model_stats(PRESETS["deepseek-v2-lite"].config(), "deepseek-v2-lite")
    assert sum(v2.four_bit_numels()) > 0.95 * v2.total and sum(v2.dequantised_experts) == v2.routed_experts
    lora = plan.recommend(v2, N, 2048, gpu, cpu, lora_rank=16)
    qlora = plan.recommend(v2, N, 2048, gpu, cpu, lora_rank=16, four_bit=True)
    assert lora is not None and lora.setup.stage == 3
    assert qlora is not None and qlora.setup.stage == 2 and qlora.micro_batch >= lora.micro_batch
    whole = plan.four_bit_base_bytes(v2, qlora.setup)
    assert qlora.estimate.load == whole < 9 * GiB  # the whole 4-bit base on each card
    assert qlora.estimate.host_load > 2 * v2.routed_experts  # one rank's experts in 16 bits, before quantising
    from deepzero.plan.memory import dequantised_bytes

    # the fused experts a layer dequantises; without checkpointing autograd keeps every layer's for backward
    assert dequantised_bytes(v2, qlora.setup) == 2 * max(v2.dequantised_experts) == 2 * v2.routed_experts // 26
    assert dequantised_bytes(v2, replace(qlora.setup, checkpointing=False)) == 2 * v2.routed_experts


def cache_test_config(name: str) -> Any:
    """A preset's config, or for "qwen2-gqa" a tiny Qwen2 with grouped KV heads (the KV-cache measurements)."""
    from transformers import Qwen2Config

    if name == "qwen2-gqa":
        return Qwen2Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
    return get_preset(name).config()


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2", "qwen2-gqa"])
def test_grpo_plans_the_kv_cache_transformers_really_keeps(name: str) -> None:
    """The planner's KV cache of a GRPO group equals the bytes of the DynamicCache Transformers' forward builds for
    G rows of prompt + completion (MLA: the latent and the rotary key; GQA: every KV head's key and value)."""
    from transformers import AutoModelForCausalLM

    config = cache_test_config(name)
    stats = model_stats(config, name)
    setup = Setup(stage=2, world_size=N, seq_len=12, precision="fp32", grpo=plan.GrpoTerms(3, prompt_len=5))
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 100, (3, 12)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == plan.kv_cache_bytes(stats, setup) > 0


def test_grpo_adds_generation_to_the_peak_and_answers_the_issues_models() -> None:
    """Generation (KV cache, prefill, logits; ZeRO-3's gathered model) and the frozen reference copy count on the
    card; R1-Distill-Qwen-1.5B and 7B on 3 × 24 GiB: completions grow with checkpointing and LoRA, 7B trains only
    with LoRA."""
    stats = model_stats(PRESETS["deepseek-r1-distill-qwen-7b"].config(), "7b")
    grpo = plan.GrpoTerms(8, prompt_len=512)
    base = Setup(stage=3, world_size=N, seq_len=512 + 2048, lora_rank=16, checkpointing=True)
    plain, with_grpo = estimate(stats, base), estimate(stats, replace(base, grpo=grpo))
    gathered = 2 * stats.total
    kv = plan.kv_cache_bytes(stats, replace(base, grpo=grpo))
    assert kv == 8 * 2560 * 28 * (2 * 4 * 128) * 2  # G × tokens × layers × (k + v of 4 KV heads × 128) × bf16
    assert with_grpo.generation > gathered + kv and plain.generation == 0
    assert with_grpo.gpu_total > plain.gpu_total
    full = replace(base, stage=2, lora_rank=0, grpo=replace(grpo, reference_copy=True))
    assert estimate(stats, full).params == estimate(stats, replace(full, grpo=grpo)).params + 2 * stats.total
    with pytest.raises(UserError, match="leave no completion"):
        replace(base, seq_len=512, grpo=grpo)
    for name, full_fits in (("deepseek-r1-distill-qwen-1.5b", True), ("deepseek-r1-distill-qwen-7b", False)):
        model = model_stats(PRESETS[name].config(), name)
        full = plan.longest_completions(model, N, 24 * GiB, 128 * GiB, grpo)
        lora = plan.longest_completions(model, N, 24 * GiB, 128 * GiB, grpo, lora_rank=16)
        qlora = plan.longest_completions(model, N, 24 * GiB, 128 * GiB, grpo, lora_rank=16, four_bit=True)
        assert (max(r.seq_len for r in full) > 0) == full_fits, name
        assert max(r.seq_len for r in lora) >= max(r.seq_len for r in full)
        assert max(r.seq_len for r in qlora) > max(r.seq_len for r in lora)  # the 4-bit base leaves more room
        assert all(r.seq_len == 0 for r in qlora if r.preset == "zero3_offload")  # parameter offload: refused
        assert all(r.setup.four_bit for r in qlora if r.preset != "zero3_offload")
        for r in [*full, *lora, *qlora]:
            if r.seq_len:
                assert r.estimate.fits(24 * GiB, 128 * GiB)
                assert not estimate(model, replace(r.setup, seq_len=r.setup.seq_len + 256)).fits(24 * GiB, 128 * GiB)
        ckpt = {(r.preset, r.setup.checkpointing): r.seq_len for r in lora}
        assert all(ckpt[p, True] >= ckpt[p, False] for p, _ in ckpt)


def test_grpo_plans_the_rows_generated_together_and_the_most_that_fit() -> None:
    """The KV cache and the prefill grow with the rows one generate call takes (a rank's rows, not one group);
    ``generation_rows`` is the most rows that fit beside training: one more does not."""
    stats = model_stats(PRESETS["deepseek-r1-distill-qwen-1.5b"].config(), "1.5b")
    one_group = Setup(stage=2, world_size=N, seq_len=512 + 1024, lora_rank=16, grpo=plan.GrpoTerms(8, 512))
    batched = replace(one_group, grpo=replace(one_group.grpo, rows=32))
    assert plan.kv_cache_bytes(stats, batched) == 4 * plan.kv_cache_bytes(stats, one_group)
    assert estimate(stats, batched).generation > estimate(stats, one_group).generation
    gpu, cpu = 24 * GiB, 128 * GiB
    rows = plan.generation_rows(stats, one_group, gpu, cpu, 10_000)
    assert 8 < rows < 10_000

    def fits(n: int) -> bool:
        return estimate(stats, replace(one_group, grpo=replace(one_group.grpo, rows=n))).fits(gpu, cpu)

    assert fits(rows) and not fits(rows + 1)
    assert plan.generation_rows(stats, one_group, gpu, cpu, 16) == 16  # a rank's rows, when they all fit


def test_cli_grpo_prints_the_longest_completions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "deepseek-r1-distill-qwen-1.5b", "--grpo", "--num-generations", "4", "--prompt-len", "256"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 completion rows generated together (G 4), prompts of 256 tokens" in out
    assert "LoRA rows per call at 1,024" in out
    assert "zero3_offload" in out and "LoRA r16 (KV cache, GPU GiB)" in out and "KV " in out
    assert "QLoRA r16 (KV cache, GPU GiB)" in out
    assert plan.main([*argv[:3], "--num-generations", "0"]) == 2


def test_cli_grpo_plans_its_micro_batch(capsys: pytest.CaptureFixture[str]) -> None:
    """--grpo --micro-batch N trains N prompt + completion rows at a time (train.py's GRPO micro-batch counts
    completions): a larger one shortens the longest completion and raises the peak at a given length."""
    stats = model_stats(PRESETS["deepseek-r1-distill-qwen-1.5b"].config(), "1.5b")
    grpo, gpu, cpu = plan.GrpoTerms(8, prompt_len=512), 24 * GiB, 128 * GiB
    one = plan.longest_completions(stats, N, gpu, cpu, grpo, lora_rank=16)
    four = plan.longest_completions(stats, N, gpu, cpu, grpo, lora_rank=16, micro_batch=4)
    assert all(r.setup.micro_batch == 4 and r.estimate.fits(gpu, cpu) for r in four if r.seq_len)
    assert all(f.seq_len <= o.seq_len for o, f in zip(one, four, strict=True))
    assert sum(f.seq_len for f in four) < sum(o.seq_len for o in one)
    at = replace(one[1].setup, seq_len=512 + 2048)  # zero2_bf16, checkpointing on
    assert estimate(stats, replace(at, micro_batch=4)).gpu_total > estimate(stats, at).gpu_total
    argv = ["--model", "deepseek-r1-distill-qwen-1.5b", "--grpo"]
    outs = []
    for micro in ("1", "4"):
        assert plan.main([*argv, "--micro-batch", micro]) == 0
        outs.append(capsys.readouterr().out)
    assert "micro-batch 1 (completions;" in outs[0] and "micro-batch 4 (completions;" in outs[1]
    tables = [out.split("\n\n")[1] for out in outs]
    assert tables[0] != tables[1]  # the figures, not only the header, follow --micro-batch


@pytest.mark.parametrize("targets", ["attn", "attn,experts"])
def test_lora_spec_counts_what_peft_wraps(targets: str) -> None:
    """check_fit's LoRA trainable count is the one apply_lora leaves trainable (tiny V3: 16,640 attn; 68,864 with
    the fused routed experts)."""
    from transformers import AutoModelForCausalLM

    from deepzero.adapters.lora import apply_lora

    config, spec = get_preset("tiny-deepseek-v3").config(), LoraSpec.parse(f"r=4,targets={targets}")
    model = apply_lora(AutoModelForCausalLM.from_config(config), spec)
    wrapped = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(model_stats(config, lora=spec).lora_numels(spec.r)) == wrapped


def test_cross_check_with_deepspeed_estimators(coder: plan.ModelStats) -> None:
    """DeepSpeed's own estimators agree once their documented differences are accounted for (docs/memory.md)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds2

    psi, ll, f = coder.total, coder.largest_module, 1.5  # f: DeepSpeed's additional_buffer_factor on host RAM

    def states(e: plan.Estimate) -> int:
        return e.params + e.grads + e.optimizer + e.step

    e = estimate(coder, Setup(stage=2, world_size=N))
    _, gpu = ds2(psi, num_gpus_per_node=N, cpu_offload=False)
    assert close(states(e), gpu, 0.01)  # 2Ψ + 18Ψ/N (16-bit + fp32 grads, master, m, v)

    e = estimate(coder, Setup(stage=2, world_size=N, offload_optimizer=True))
    cpu, gpu = ds2(psi, num_gpus_per_node=N, cpu_offload=True)
    assert close(states(e), gpu, 1e-6)
    assert close(e.host_states, cpu / f + 2 * psi, 1e-6)  # + the 16-bit staging copy DeepSpeed allocates

    e = estimate(coder, Setup(stage=3, world_size=N))
    _, gpu, largest = ds3(psi, ll, num_gpus_per_node=N, cpu_offload=False, cpu_offload_params=False)
    assert largest == 4 * ll and e.buffers >= largest
    assert close(states(e) - 2 * psi / N, gpu - largest, 0.01)  # DeepSpeed omits the 16-bit grad partition

    e = estimate(coder, Setup(stage=3, world_size=N, offload_optimizer=True))
    cpu, gpu, largest = ds3(psi, ll, num_gpus_per_node=N, cpu_offload=True, cpu_offload_params=False)
    assert close(states(e), gpu - largest, 0.01)
    assert close(e.host_states - 2 * psi, cpu / f, 0.01)  # + the host 16-bit grad buffer

    e = estimate(coder, Setup(stage=3, world_size=N, offload_optimizer=True, offload_params=True))
    cpu, gpu, largest = ds3(psi, ll, num_gpus_per_node=N, cpu_offload=True, cpu_offload_params=True)
    assert gpu == largest and states(e) == e.params < 0.001 * 2 * psi / N  # only persistent norms on the card
    assert close(e.host_states - 2 * psi, cpu / f, 0.01)


# ---------------------------------------------------------------------------------------- activations


def test_dense_activations_per_layer(coder: plan.ModelStats) -> None:
    """Korthikanti et al. without dropout and s² terms, SwiGLU MLP, fp32 RMSNorm inputs (docs/memory.md)."""
    h, i, a, layers, s = 2048, 5504, 16, 24, 2048
    per_layer = 12 * h + 12 * h + 4 * a + 2 * h + 8 * i  # norms, attention, MLP
    setup = Setup(stage=2, world_size=N, micro_batch=2, seq_len=s)
    t = 2 * s
    assert plan.activation_bytes(coder, setup) == t * (layers * per_layer + 8 * h)
    ckpt = replace(setup, checkpointing=True)
    assert plan.activation_bytes(coder, ckpt) == t * (layers * 2 * h + per_layer + 8 * h)
    eager = replace(setup, attention="eager")
    assert plan.activation_bytes(coder, eager) - plan.activation_bytes(coder, setup) == layers * t * 7 * a * s
    assert plan.logits_bytes(coder, setup) == 14 * t * 32256


def test_moe_activations_grow_with_experts_per_token() -> None:
    base = model_stats(get_preset("tiny-deepseek-v3").config())
    more = model_stats(get_preset("tiny-deepseek-v3").config(num_experts_per_tok=4))
    setup = Setup(stage=2, world_size=N, seq_len=64)
    h, i_moe, moe_layers = 128, 96, 3
    diff = plan.activation_bytes(more, setup) - plan.activation_bytes(base, setup)
    assert diff == moe_layers * 64 * 2 * (4 * h + 8 * i_moe)  # two more expert copies per token


def test_setup_from_ds_config_reads_buckets_and_auto() -> None:
    ds = plan.load_preset("zero3_offload")
    setup = plan.setup_from_ds_config(ds, world_size=N, seq_len=128, hidden_size=1000)
    assert (setup.stage, setup.offload_optimizer, setup.offload_params, setup.precision) == (3, True, True, "bf16")
    auto = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    setup = plan.setup_from_ds_config(auto, world_size=N, seq_len=128, hidden_size=1000)
    assert (setup.zero.reduce_bucket_size, setup.zero.prefetch_bucket_size) == (1_000_000, 900_000)
    with pytest.raises(UserError, match="stage 3"):
        Setup(stage=2, world_size=N, offload_params=True)


# ------------------------------------------------------------------------------------- CLI + check_fit


def test_cli_table_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "deepseek-coder-1.3b", "--gpus", "3", "--gpu-mem", "24", "--cpu-mem", "128"]
    assert plan.main([*argv, "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("ZeRO"))
    table = lines[start : lines.index("", start)]
    assert len({len(line) for line in table}) == 1, "columns are aligned"
    assert {line.split()[0] for line in table[2:]} == {"1", "2", "3"}
    # 7 stage/offload combos × full/LoRA × checkpointing off/on, and QLoRA on the 6 without parameter offload
    assert len(table) == 2 + 7 * 2 * 2 + 6 * 2
    assert "opt+param" in out and "LoRA r16" in out and "QLoRA r16" in out and "✓" in out
    assert not any("QLoRA" in line and "param" in line for line in table)
    assert "Recommended for full fine-tuning: ds_configs/zero2_bf16.json" in out


def test_cli_plans_a_preference_pair_as_two_untiled_sequences_and_recommends_whole_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--preference: the table of micro-batch N pairs is the table of 2N sequences (log-probs tiled like the LM
    loss, no reference model added), and a recommendation is a whole pair."""
    argv = ["--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "--seq-len", "4096"]

    def table(*extra: str) -> tuple[list[str], str]:
        assert plan.main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        start = next(n for n, line in enumerate(lines) if line.startswith("ZeRO"))
        return lines[start : lines.index("", start)], out

    pairs, out = table("--preference", "--micro-batch", "2")
    rows, _ = table("--micro-batch", "4")
    half, _ = table("--micro-batch", "2")
    assert pairs == rows and pairs != half
    assert "micro-batch 2 pairs = 4 sequences" in out
    recommended = [line for line in out.splitlines() if line.startswith("Recommended for")]
    assert len(recommended) == 3 and all(" pair " in line or " pairs " in line for line in recommended), recommended
    assert plan.main([*argv, "--preference", "--max-seq-len"]) == 2
    assert "error: --max-seq-len:" in capsys.readouterr().err


def test_cli_says_nothing_fits_for_deepseek_v3(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--model", "deepseek-v3", "--gpus", "3", "--gpu-mem", "24", "--cpu-mem", "128"]) == 0
    out = capsys.readouterr().out
    assert "✓" not in out
    assert out.count("nothing fits") == 3  # full, LoRA and QLoRA


def test_model_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: plan.ModelStats) -> None:
    assert planning_config("deepseek-ai/deepseek-coder-1.3b-base")[0] == "deepseek-coder-1.3b"
    get_preset("tiny-deepseek-v3").config().save_pretrained(tmp_path)
    name, config = planning_config(str(tmp_path))
    assert model_stats(config, name).total == tiny.total

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(modeling.AutoConfig, "from_pretrained", offline)
    with pytest.raises(UserError, match=r"deepseek-coder-1\.3b"):
        planning_config("someone/unknown-model")
    assert plan.main(["--model", "someone/unknown-model"]) == 2


def _resolved(model: str, preset: str, world: int, **choice: object) -> tuple[object, object, object]:
    """The decisions plan_run makes for ``--model model --deepspeed_config ds_configs/preset.json`` (engine settings
    from engines.choose, the config from dsconfig.resolve), on faked 16-bit kernels so presets keep their types."""
    config = PRESETS[model].config()
    path = str(REPO / "ds_configs" / f"{preset}.json")
    spec = LoraSpec.parse(choice["lora"]) if choice.get("lora") else None
    raw = dsconfig.load_json(path)
    settings = engines.choose(
        raw, path, choice.get("device_map"), choice.get("devices"), bool(choice.get("ckpt")), spec
    )
    hints = dsconfig.TrainingHints(max_steps=10, hidden_size=config.hidden_size, micro_batch=choice.get("micro"))
    cfg = dsconfig.resolve(path, settings.dp_size(world), hints, kernels=NATIVE_16BIT)
    return config, settings, cfg


def _fit(model: str, preset: str, world: int, gpu: float, cpu: float, **choice: object) -> tuple[str | None, ...]:
    """(check_fit's warning, its busiest estimate, the old check's estimate: the preset read as plain ZeRO, full
    fine-tune, fp32 weights while loading; only --gradient-checkpointing reached it)."""
    config, settings, cfg = _resolved(model, preset, world, **choice)
    pretrained = bool(choice.get("pretrained", True))
    warning = plan.check_fit(
        config, settings, cfg, 2048, world_size=world, pretrained=pretrained, gpu_mem_gb=gpu, cpu_mem_gb=cpu
    )
    setup = plan.run_setup(config, settings, cfg, 2048, world, pretrained)
    new = estimate(model_stats(config, model, lora=getattr(settings, "lora", None)), setup)
    old_setup = plan.setup_from_ds_config(
        cfg.ds,
        world_size=world,
        seq_len=2048,
        hidden_size=config.hidden_size,
        micro_batch=cfg.batch.micro,
        checkpointing=bool(choice.get("ckpt")),
    )
    old = estimate(model_stats(config, model), old_setup)
    return warning, new, old


def gib(n: float) -> float:
    return round(n / GiB, 1)


def test_check_fit_zero_plans_pretrained_weights_in_the_training_dtype() -> None:
    """deepseek-coder-1.3b, zero2_bf16 micro 2 on 3 × 24 GiB: the card fits (21.8 GiB); a 20 GiB host holds the
    3 ranks' bf16 checkpoint loads (16.5 GiB) but not random-init fp32 builds (24.0 GiB, the old plan for both)."""
    warning, new, old = _fit("deepseek-coder-1.3b", "zero2_bf16", N, 24, 20, micro=2)
    assert warning is None, warning
    assert (gib(new.gpu_total), gib(new.host), gib(old.host)) == (21.8, 16.5, 24.0)
    assert not old.fits(24 * GiB, 20 * GiB)  # the false warning
    scratch, _, _ = _fit("deepseek-coder-1.3b", "zero2_bf16", N, 24, 20, micro=2, pretrained=False)
    assert scratch and "host RAM" in scratch and "fp32 random-init" in scratch and "\n" not in scratch
    too_big, new, _ = _fit("deepseek-coder-1.3b", "zero2_bf16", N, 24, 128, micro=4)
    assert gib(new.gpu_total) == 33.0
    assert too_big and too_big.startswith("memory plan: ZeRO-2 at micro-batch 4") and "micro-batch 2 fits" in too_big


def test_check_fit_plans_preference_pairs_as_two_sequences_and_advises_whole_pairs() -> None:
    """A preference run's micro-batch of 2 pairs is 4 sequences: the same 33.0 GiB as the LM run at micro 4 above,
    and the warning speaks in pairs, advising the 2 sequences that fit as 1 pair."""
    config, settings, cfg = _resolved("deepseek-coder-1.3b", "zero2_bf16", N, micro=2)
    kw = {"world_size": N, "pretrained": True, "gpu_mem_gb": 24, "cpu_mem_gb": 128}
    pairs = plan.check_fit(config, settings, cfg, 2048, rows_per_sample=2, **kw)
    assert pairs and pairs.startswith("memory plan: ZeRO-2 at micro-batch 2 pairs (4 sequences), seq 2048 needs ~33.0")
    assert "micro-batch 1 pair (2 sequences) fits" in pairs and "\n" not in pairs
    assert plan.check_fit(config, settings, cfg, 2048, **kw) is None  # the same 2 rows as one LM micro-batch fit


def test_check_fit_plans_lora_runs_as_lora() -> None:
    """The issue's case: R1-Distill-Qwen-14B, LoRA r16 on attention, zero2_bf16 + checkpointing, micro 1, 3 ranks.
    Old plan: a full fine-tune, 116.7 GiB per card and 174.1 GiB (187 GB) of host; engine: frozen bf16 base, 36.6
    GiB per card, host 91.5 GiB (98 GB). Fits 3 × 80 GiB; on 24 GiB cards the 27.6 GiB of weights do not."""
    lora = {"lora": "r=16,targets=attn", "ckpt": True, "micro": 1}
    warning, new, old = _fit("deepseek-r1-distill-qwen-14b", "zero2_bf16", N, 80, 128, **lora)
    assert warning is None, warning
    assert (gib(old.gpu_total), gib(old.host)) == (116.7, 174.1)
    assert (gib(new.gpu_total), gib(new.host), gib(new.params)) == (36.6, 91.5, 27.6)
    assert new.trainable < 0.01 * model_stats(PRESETS["deepseek-r1-distill-qwen-14b"].config()).total
    small, _, _ = _fit("deepseek-r1-distill-qwen-14b", "zero2_bf16", N, 24, 128, **lora)
    assert small and small.startswith("memory plan: ZeRO-2 + LoRA r16 at micro-batch 1") and "zero3" in small


def test_check_fit_plans_each_pipeline_stage() -> None:
    """ds_configs/pipeline.json (3 stages, ZeRO-1 + BF16_Optimizer, micro 2 × 6): each stage holds a third of the
    layers; stage 0 keeps 3 micro-batches in flight. deepseek-coder-6.7b: 68.2 GiB on stage 0, fits 3 × 80 GiB
    (the old plan, one ZeRO-1 replica of the whole model: 81.6 GiB), and warns on 24 GiB cards."""
    warning, new, old = _fit("deepseek-coder-6.7b", "pipeline", N, 80, 128)
    assert warning is None, warning
    assert (gib(new.gpu_total), new.where, gib(old.gpu_total)) == (68.2, "pipeline stage 0", 81.6)
    config, settings, cfg = _resolved("deepseek-coder-6.7b", "pipeline", N)
    setup = plan.run_setup(config, settings, cfg, 2048, N, True)
    stats = model_stats(config)
    held = [plan.shares(stats, setup)[s] for s in range(3)]
    assert [i for share in held for i in share.layers] == list(range(32))  # every layer on exactly one stage
    assert sum(sum(share.trainable) for share in held) == stats.total
    assert [share.in_flight for share in held] == [3, 2, 1] and [share.head for share in held] == [False] * 2 + [True]
    small, _, _ = _fit("deepseek-coder-6.7b", "pipeline", N, 24, 128)
    assert small and small.startswith("memory plan: pipeline 3 stages × data-parallel 1") and "stage 0" in small


def test_check_fit_plans_each_card_of_the_layer_split() -> None:
    """--device-map balanced over 3 cards, one process: each card holds its layers' weights, gradients and fp32
    AdamW state. deepseek-coder-1.3b micro 2: 12.7 GiB on the busiest card (the old plan, the whole model on one
    ZeRO-2 rank: 34.1 GiB); deepseek-coder-6.7b: 47.1 GiB on card 0, over 24 GiB."""
    split = {"device_map": "balanced", "devices": "0,1,2"}
    warning, new, old = _fit("deepseek-coder-1.3b", "zero2_bf16", 1, 24, 128, micro=2, **split)
    assert warning is None, warning
    assert (gib(new.gpu_total), gib(old.gpu_total)) == (12.7, 34.1)
    assert gib(new.host) == 5.5  # one process: 3 GiB + the bf16 checkpoint
    small, new, _ = _fit("deepseek-coder-6.7b", "zero2_bf16", 1, 24, 128, micro=1, **split)
    assert gib(new.gpu_total) == 47.1
    assert small and small.startswith("memory plan: layer split over 3 cards") and "card" in small


def test_check_fit_says_nothing_fits_for_deepseek_v3() -> None:
    config, settings, cfg = _resolved("deepseek-v3", "zero3_offload", N, micro=1)
    v3 = plan.check_fit(config, settings, cfg, 2048, world_size=N, pretrained=True, gpu_mem_gb=24, cpu_mem_gb=128)
    assert v3 and "no ds_configs preset fits" in v3
    if plan.detected_gpu_mem_gb() is None:  # no CUDA: nothing to check
        assert plan.check_fit(config, settings, cfg, 2048, world_size=N, pretrained=True) is None


def test_max_micro_batch_is_the_largest_that_fits(coder: plan.ModelStats) -> None:
    setup = Setup(stage=2, world_size=N, zero=ZeroKnobs(reduce_bucket_size=200_000_000, overlap_comm=True))
    mb = plan.max_micro_batch(coder, setup, 24 * GiB, 128 * GiB)
    assert mb >= 1
    assert estimate(coder, replace(setup, micro_batch=mb)).fits(24 * GiB)
    assert not estimate(coder, replace(setup, micro_batch=mb + 1)).fits(24 * GiB)


# ------------------------------------------------------------- measured: a real 3-rank DeepSpeed engine


@pytest.mark.launcher
@pytest.mark.parametrize("stage", [2, 3])
def test_predicted_bytes_equal_what_deepspeed_holds(
    stage: int, tmp_path: Path, tiny: plan.ModelStats, tiny_data: Path
) -> None:
    """Full fine-tuning of tiny-deepseek-v3 (every state), then train.py's own QLoRA engine in the same launch on a
    tiny DeepSeek-V2: the 4-bit base's parameter bytes per rank (NF4 codes of the Linear layers and of the fused
    routed experts, their QuantStates, the other weights, the adapters)."""
    from helpers.zero_bytes import qlora_argv
    from test_qlora import pretrained_moe

    from deepzero.run import plan_run

    out, base = tmp_path / f"zero{stage}.json", pretrained_moe(tmp_path / "v2")
    env = cpu_env(PYTHONPATH=str(REPO))
    qlora = ["--qlora-base", str(base), "--qlora-data", str(tiny_data)]
    launch(
        ["--stage", str(stage), "--out", str(out), *qlora],
        nproc=N,
        env=env,
        timeout=600,
        script="tests/helpers/zero_bytes.py",
    )
    measured = json.loads(out.read_text())
    run = plan_run(parse_args(qlora_argv(stage, str(base), str(tiny_data), str(tmp_path / "qlora"))), N)
    setup = plan.run_setup(run.config, run.engine_settings, run.cfg, run.seq_len, N, True)
    assert setup.four_bit and setup.label() == f"ZeRO-{stage} + QLoRA r8"
    stats = model_stats(run.config, "v2", lora=run.engine_settings.lora)
    quantised = stats.four_bit_numels()
    model = modeling.AutoModelForCausalLM.from_pretrained(base)
    linears = [m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear]
    experts = [p.numel() for n, p in model.named_parameters() if p.dim() == 3]
    assert experts and sum(quantised) == sum(linears) - model.lm_head.weight.numel() + sum(experts)
    predicted = estimate(stats, setup).params
    for m in measured["ranks"]:
        held = m["qlora"]["params"] + m["qlora"]["quant_state"]
        assert held == predicted, f"rank {m['rank']}: holds {held} B of parameters, planned {predicted} B"
        assert m["qlora"]["quant_state"] == sum(map(quant.quant_state_bytes, quantised))
    setup = plan.setup_from_ds_config(measured["ds_config"], world_size=N, seq_len=32, hidden_size=128)
    predicted = rank_states(tiny.param_numels, (), setup)
    for rank, (m, p) in enumerate(zip(measured["ranks"], predicted, strict=True)):
        assert m["rank"] == rank
        pairs = {
            "params": (m["params"], 2 * p.params),
            "grads": (m["grads"], 2 * p.grads),
            "master": (m["master"], 4 * p.optimizer),
            "exp_avg": (m["exp_avg"], 4 * p.optimizer),
            "exp_avg_sq": (m["exp_avg_sq"], 4 * p.optimizer),
        }
        for what, (got, want) in pairs.items():
            assert close(got, want, 0.02), f"rank {rank} {what}: measured {got} B, predicted {want} B"
    busiest = estimate(tiny, setup)
    assert close(busiest.params + busiest.grads, max(m["params"] + m["grads"] for m in measured["ranks"]), 0.02)
    assert close(busiest.optimizer, max(m["master"] + m["exp_avg"] + m["exp_avg_sq"] for m in measured["ranks"]), 0.02)


def test_gpu_bench_exits_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():  # the bench looks at torch's CUDA, whatever accelerator the test ranks use
        pytest.skip("CUDA present: run bench/gpu_memory.py by hand")
    proc = subprocess.run(
        [sys.executable, "bench/gpu_memory.py"], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout


# ------------------------------------------------------------------------------------ long sequences


@pytest.fixture(scope="module")
def qwen() -> plan.ModelStats:
    return model_stats(PRESETS["deepseek-r1-distill-qwen-1.5b"].config(), "deepseek-r1-distill-qwen-1.5b")


def _run_savers(config: object, seq_len: int, **flags: object) -> plan.SaverTerms:
    """SaverTerms of the MemorySavers train.py's planning step chooses for these flags."""
    from argparse import Namespace

    from deepzero.memory_savers import MemorySavers

    defaults = {"tiled_loss": "on", "gradient_checkpointing": False, "activation_offload": False, "tiled_mlp": "1"}
    args = Namespace(**{**defaults, **flags, "device_map": None})
    return plan.SaverTerms.of(MemorySavers.choose(args, config, seq_len, pipeline=False))


def test_tiled_loss_removes_the_tokens_by_vocab_term(qwen: plan.ModelStats) -> None:
    """R1-Distill-Qwen-1.5B at 16k, bf16: the whole logits cost 32.5 GiB; the tiled loss (99 tiles, train.py's
    default, each tile at least 256 rows) 1.9 GiB, of which 1.3 GiB is the [V × H] fp32 grad_weight buffer and its
    final 16-bit cast (the vocabulary blocks' products are smaller: before issue 30 each tile's whole [V × H] 16-bit
    product and its fp32 copy made it 2.7 GiB). The planner's number is the loss's own ``working_bytes``."""
    v, h, s = 151_936, 1536, 16_384
    terms = _run_savers(PRESETS["deepseek-r1-distill-qwen-1.5b"].config(), s)
    assert terms == plan.SaverTerms(loss_tiles=math.ceil(v / h)) == plan.SaverTerms.choose(qwen.arch)
    untiled = Setup(stage=2, world_size=N, seq_len=s)
    tiled = replace(untiled, savers=terms)
    assert gib(plan.logits_bytes(qwen, untiled)) == 32.5
    assert gib(plan.logits_bytes(qwen, tiled)) == 1.9
    rows = max(math.ceil(s / 99), 256)
    block = vocab_block(rows, v, h) * h  # 166 rows x 151,936 / 1536 = 16,420 vocabulary rows: 6 B each < the cast
    assert plan.logits_bytes(qwen, tiled) == 14 * rows * v + 4 * v * h + max(2 * v * h, 6 * block) + 4 * s + 2 * s * h
    assert plan.logits_bytes(qwen, tiled) == TiledLoss(True, 99).working_bytes(s, v, h, 2)
    # per added token the tiled loss grows by a tile row's share, not by a [1 × vocab] row of fp32 tensors
    grow = plan.logits_bytes(qwen, replace(tiled, seq_len=2 * s)) - plan.logits_bytes(qwen, tiled)
    assert grow < 0.02 * (plan.logits_bytes(qwen, replace(untiled, seq_len=2 * s)) - plan.logits_bytes(qwen, untiled))
    off = _run_savers(PRESETS["deepseek-r1-distill-qwen-1.5b"].config(), s, tiled_loss="off")
    assert off == plan.SaverTerms() and plan.logits_bytes(qwen, replace(untiled, savers=off)) == 14 * s * v


def test_offload_moves_the_checkpointed_hidden_states_to_host(qwen: plan.ModelStats) -> None:
    """--activation-offload: the 28 checkpointed layer inputs (2 B × hidden per token each) leave the card but
    the one being recomputed, and every rank's copies are host RAM (3 ranks × 28 × 2 × 1536 × 32k = 7.9 GiB)."""
    s, layers, h = 32_768, 28, 1536
    config = PRESETS["deepseek-r1-distill-qwen-1.5b"].config()
    ckpt = Setup(stage=2, world_size=N, seq_len=s, checkpointing=True, savers=_run_savers(config, s))
    offload = replace(ckpt, savers=_run_savers(config, s, gradient_checkpointing=True, activation_offload=True))
    assert offload.savers.offload and not ckpt.savers.offload
    on_card = plan.activation_bytes(qwen, ckpt) - plan.activation_bytes(qwen, offload)
    assert on_card == (layers - 1) * 2 * h * s
    moved = estimate(qwen, offload).host_states - estimate(qwen, ckpt).host_states
    assert moved == N * layers * 2 * h * s and gib(moved) == 7.9
    no_ckpt = replace(offload, checkpointing=False)  # nothing is checkpointed, so nothing moves
    assert plan.offloaded_bytes(qwen, no_ckpt) == 0


def test_tiled_mlp_keeps_one_tiles_intermediates(qwen: plan.ModelStats) -> None:
    """--tiled-mlp on at 32k (ceil(32768 / 1536) = 22 tiles): the recomputed layer keeps its MLP input, and one
    tile's intermediates (8 B × 8960 per token) live instead of the whole sequence's."""
    s, i, h = 32_768, 8960, 1536
    config = PRESETS["deepseek-r1-distill-qwen-1.5b"].config()
    ckpt = Setup(stage=2, world_size=N, seq_len=s, checkpointing=True, savers=_run_savers(config, s))
    mlp = replace(ckpt, savers=_run_savers(config, s, gradient_checkpointing=True, tiled_mlp="on"))
    assert mlp.savers.mlp_tiles(qwen.arch, s) == 22
    tile = math.ceil(s / 22)
    saved = plan.activation_bytes(qwen, ckpt) - plan.activation_bytes(qwen, mlp)
    assert saved == 8 * i * s - (tile * (8 * i + 2 * h) + 2 * h * s)


@pytest.mark.parametrize(
    ("model", "lora", "before", "after"),
    [
        ("deepseek-r1-distill-qwen-1.5b", 0, 9216, 742_400),
        ("deepseek-r1-distill-qwen-7b", 16, 8192, 330_752),
        ("deepseek-r1-distill-llama-8b", 16, 9216, 281_600),
    ],
)
def test_longest_sequence_meets_the_long_context_goal(model: str, lora: int, before: int, after: int) -> None:
    """Issue 23 item 4 on 3 × 24 GiB cards and 128 GiB host, micro-batch 1: R1-Distill-Qwen-1.5B full fine-tune
    and R1-Distill-Qwen-7B / Llama-8B LoRA r16 at 32,768 tokens or more. Before (untiled loss, checkpointing the
    only saver) 8-9k; with the tiled loss, offloaded checkpoints, the tiled MLP and 3-way sequence parallelism under
    zero3_offload, 281-742k; a LoRA run's frozen LM head keeps no [V × H] weight gradient (issue 24's goal: 1.5B
    full >= 131,072, 7B and 8B LoRA >= 65,536)."""
    stats = model_stats(PRESETS[model].config(), model)
    gpu, cpu = 24 * GiB, 128 * GiB
    only_ckpt = ((False, False, False), (True, False, False))
    old = plan.longest_sequence(
        stats, N, gpu, cpu, lora_rank=lora, tiled_loss=False, choices=only_ckpt, sequence_parallel=False
    )
    new = plan.longest_sequence(stats, N, gpu, cpu, lora_rank=lora)
    assert old is not None and new is not None
    assert (old.seq_len, new.seq_len) == (before, after)
    assert new.seq_len >= 32_768 and new.preset == "zero3_offload"
    assert new.setup.sequence_parallel == N and new.seq_len >= (131_072 if lora == 0 else 65_536)  # issue 24
    assert new.setup.savers.offload and new.setup.savers.tiled_mlp and new.setup.savers.loss_tiles
    assert estimate(stats, replace(new.setup, seq_len=after)).fits(gpu, cpu)
    assert not estimate(stats, replace(new.setup, seq_len=after + plan.SEQ_STEP)).fits(gpu, cpu)


def test_cli_max_seq_len(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--model", "deepseek-coder-1.3b", "--max-seq-len"]) == 0
    out = capsys.readouterr().out
    assert (
        len([line for line in out.splitlines() if line.startswith("zero")]) == 5 * len(plan.SAVER_CHOICES) * 2
    )  # each also with SP 3
    assert "Longest for full fine-tuning: " in out and "over the 16,384 context" in out
    assert plan.main(["--model", "deepseek-coder-1.3b", "--tiled-loss", "off", "--tiled-mlp", "on"]) == 0
    assert "Memory savers: untiled loss + tiled MLP" in capsys.readouterr().out


def test_sequence_parallelism_divides_the_slices_and_adds_the_gathered_keys_and_the_mask(qwen: plan.ModelStats) -> None:
    """--sequence-parallel 3 (issue 24): a rank holds a third of each row's tokens (activations, logits, offloaded
    inputs), plus the layer's all-gathered keys/values of the whole rows (12/2 heads × 128: 1 KiB per token) and
    one attention chunk's mask (at most MASK_ELEMENTS entries: bool + bf16); the longest-sequence search tries it
    and the goal holds with it too."""
    from deepzero.sequence_parallel import MASK_ELEMENTS

    s, padded = 32_768, 32_772  # no multiple of 6: the engine pads each row, the planner counts the padded row
    terms = plan.SaverTerms.choose(qwen.arch)
    one = Setup(stage=2, world_size=N, seq_len=s, checkpointing=True, savers=terms)
    split = replace(one, sequence_parallel=3)
    third = replace(one, seq_len=padded // 3)
    assert plan.logits_bytes(qwen, split) == plan.logits_bytes(qwen, third)
    kv = plan.gathered_kv_bytes(qwen, split)
    assert kv == 2 * (2 * 2 * 128) * padded
    mask = 3 * min(MASK_ELEMENTS, padded * (padded // 6))  # a chunk within one of the rank's two pieces
    expected = plan.activation_bytes(qwen, third) + kv + mask  # one recomputed layer holds the gathered kv
    assert plan.activation_bytes(qwen, split) == expected
    rows = plan.longest_sequences(qwen, N, 24 * plan.GiB, 128 * plan.GiB)
    assert {r.setup.sequence_parallel for r in rows} == {1, 3}
    assert max(r.seq_len for r in rows if r.setup.sequence_parallel == 3) >= 131_072


def test_a_model_of_another_layout_is_one_line_from_the_planner(tmp_path: Path) -> None:
    """A GPT-2-shaped base (no model.layers) gets one line naming its kind, not three tracebacks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    for extra in ([], ["--evaluate"]):
        cmd = [sys.executable, "-m", "deepzero.plan", "--model", str(tmp_path / "gpt2"), *extra]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert "is a gpt2 model, whose decoder layers are not at model.layers" in line


def test_the_export_is_planned_from_the_folders_own_largest_shard(tmp_path: Path) -> None:
    """The QLoRA export holds a few of the base's shards at once: a folder on disk is planned from its own largest
    safetensors file (one file or many small ones), a hub id from the published bases' 9 GB."""
    from transformers import AutoModelForCausalLM

    from deepzero.plan.arch import model_stats
    from deepzero.plan.memory import EXPORT_SHARDS, export_host_bytes
    from deepzero.presets import get_preset

    config = get_preset("tiny-deepseek-v3").config(vocab_size=512)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_size="200KB")
    one, many = (max(p.stat().st_size for p in (tmp_path / d).glob("*.safetensors")) for d in ("one", "many"))
    assert many < one / 2
    setup = Setup(stage=2, world_size=3, lora_rank=16, four_bit=True, pretrained=True)
    costs = {}
    for name in ("one", "many"):
        stats = model_stats(config, str(tmp_path / name))
        assert stats.largest_shard_bytes == (one if name == "one" else many)
        costs[name] = export_host_bytes(stats, setup)
    assert costs["one"] - costs["many"] == EXPORT_SHARDS * (one - many)
    assert model_stats(config, "deepseek-ai/some-hub-id").largest_shard_bytes is None


def test_a_16_bit_lora_export_is_planned_from_the_files_as_qloras_is(tmp_path: Path) -> None:
    """16-bit LoRA over a base with files streams its export as QLoRA does (deepzero.adapters.exporters): the same
    figure from the folder's largest shard, whatever the ZeRO stage. A random-init base, or adapters on the fused
    experts, merges the whole model in memory (IN_MEMORY_COPIES of it); full fine-tuning plans no export here."""
    from transformers import AutoModelForCausalLM

    from deepzero.adapters.lora_export import IN_MEMORY_COPIES
    from deepzero.plan.arch import model_stats
    from deepzero.plan.memory import EXPORT_SHARDS, HOST_PER_RANK, export_host_bytes, host_bytes

    config = get_preset("tiny-deepseek-v3").config(vocab_size=512)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_size="200KB")
    stats = {d: model_stats(config, str(tmp_path / d)) for d in ("one", "many")}
    lora = Setup(stage=3, world_size=3, lora_rank=16, pretrained=True, offload_optimizer=True, offload_params=True)
    qlora = Setup(stage=2, world_size=3, lora_rank=16, four_bit=True, pretrained=True)
    for st in stats.values():
        assert (
            export_host_bytes(st, lora)
            == export_host_bytes(st, qlora)
            == export_host_bytes(st, replace(lora, stage=2, offload_params=False))
        )
    one, many = (stats[d].largest_shard_bytes for d in ("one", "many"))
    assert many < one / 2
    gap = export_host_bytes(stats["one"], lora) - export_host_bytes(stats["many"], lora)
    assert gap == EXPORT_SHARDS * (one - many)  # the shard, not the model: the old figure would not move

    st = stats["many"]
    whole = int(IN_MEMORY_COPIES * 2 * st.total)
    assert export_host_bytes(st, replace(lora, pretrained=False)) == whole  # random init: no files to stream
    assert export_host_bytes(st, replace(lora, expert_adapters=True)) == whole
    assert export_host_bytes(st, replace(lora, lora_rank=0)) == 0
    assert whole > export_host_bytes(st, lora)
    rs = rank_states(st.lora_numels(16), st.float_numels(False), lora)[0]
    host, states, load = host_bytes(st, lora, rs)  # the host column counts it: rank 0 exports, the others wait
    assert host == 3 * HOST_PER_RANK + max(states, load, export_host_bytes(st, lora))
    for targets, experts in (("attn", False), ("attn,experts", True)):  # what the run decided reaches the plan
        config, settings, cfg = _resolved("tiny-deepseek-v3", "zero2", 3, lora=f"targets={targets}")
        assert plan.run_setup(config, settings, cfg, 64, 3, True).expert_adapters == experts
