"""The memory planner: ZeRO-paper model states, DeepSpeed's estimators, activations, the CLI, and (launcher)
the per-rank bytes a real 3-rank DeepSpeed engine holds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, cpu_env, launch

from deepzero import modeling, plan
from deepzero.errors import UserError
from deepzero.modeling import planning_config
from deepzero.plan import GiB, Setup, ZeroKnobs, estimate, model_stats, rank_states
from deepzero.presets import PRESETS, get_preset

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
    assert len(table) == 2 + 7 * 2 * 2  # 7 stage/offload combos × full/LoRA × checkpointing off/on
    assert "opt+param" in out and "LoRA r16" in out and "✓" in out
    assert "Recommended for full fine-tuning: ds_configs/zero2_bf16.json" in out


def test_cli_says_nothing_fits_for_deepseek_v3(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--model", "deepseek-v3", "--gpus", "3", "--gpu-mem", "24", "--cpu-mem", "128"]) == 0
    out = capsys.readouterr().out
    assert "✓" not in out
    assert out.count("nothing fits") == 2  # full and LoRA


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


def test_check_fit() -> None:
    config = PRESETS["deepseek-coder-1.3b"].config()
    zero = {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True}
    ds = {"bf16": {"enabled": True}, "zero_optimization": zero}
    fits = {**ds, "train_micro_batch_size_per_gpu": 2}
    assert plan.check_fit(config, fits, 3, 24, 2048, cpu_mem_gb=128) is None
    too_big = {**ds, "train_micro_batch_size_per_gpu": 8}
    warning = plan.check_fit(config, too_big, 3, 24, 2048, cpu_mem_gb=128)
    assert warning and "\n" not in warning and "micro-batch 2 fits" in warning
    v3 = plan.check_fit(PRESETS["deepseek-v3"].config(), plan.load_preset("zero3_offload"), 3, 24, 2048, cpu_mem_gb=128)
    assert v3 and "no ds_configs preset fits" in v3
    if plan.detected_gpu_mem_gb() is None:
        assert plan.check_fit(config, too_big, 3, None, 2048) is None  # no CUDA: nothing to check


def test_max_micro_batch_is_the_largest_that_fits(coder: plan.ModelStats) -> None:
    setup = Setup(stage=2, world_size=N, zero=ZeroKnobs(reduce_bucket_size=200_000_000, overlap_comm=True))
    mb = plan.max_micro_batch(coder, setup, 24 * GiB, 128 * GiB)
    assert mb >= 1
    assert estimate(coder, replace(setup, micro_batch=mb)).fits(24 * GiB)
    assert not estimate(coder, replace(setup, micro_batch=mb + 1)).fits(24 * GiB)


# ------------------------------------------------------------- measured: a real 3-rank DeepSpeed engine


@pytest.mark.launcher
@pytest.mark.parametrize("stage", [2, 3])
def test_predicted_bytes_equal_what_deepspeed_holds(stage: int, tmp_path: Path, tiny: plan.ModelStats) -> None:
    out = tmp_path / f"zero{stage}.json"
    env = cpu_env(PYTHONPATH=str(REPO))
    launch(
        ["--stage", str(stage), "--out", str(out)], nproc=N, env=env, timeout=600, script="tests/helpers/zero_bytes.py"
    )
    measured = json.loads(out.read_text())
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
