"""The environment doctor (a real run on this machine, CPU or CUDA; advice and sections on fabricated reports) and
the launch files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepzero import doctor, doctor_checks
from deepzero.doctor_checks import JIT_TOOLS
from deepzero.op_builds import preset_ops
from deepzero.precision import DeviceKernels

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SHELL_NAMES = {"env_4090.sh", "single_node.sh", "multi_node.sh", "torchrun.sh", "slurm.sbatch"}
SHELL_FILES = sorted({*(LAUNCH / n for n in SHELL_NAMES), *LAUNCH.glob("*.sh")})
PRESETS = doctor_checks.load_presets()
CPU_NONE = DeviceKernels("cpu", "Old Xeon", False, False, "no avx512_fp16/amx_fp16, no avx512_bf16/amx_bf16")
CPU_BOTH = DeviceKernels("cpu", "Sapphire Rapids", True, True, "amx_fp16, amx_bf16")
T4 = DeviceKernels("cuda", "Tesla T4", True, False, "compute capability 7.5")
ALL_TOOLS = {"c++": "/usr/bin/c++", "nvcc": "/usr/local/cuda/bin/nvcc"}
NO_TOOLS: dict[str, str | None] = {"c++": None, "nvcc": None}


def _ds_info(accelerator: str, **extra: Any) -> dict[str, Any]:
    """deepspeed_info() as on a healthy install with nothing prebuilt."""
    return {"accelerator": accelerator, "ninja": True, "ops_incompatible": [], "ops_prebuilt": [], **extra}


def _report(name: str, n: int, p2p_ok: bool, env: dict[str, str | None] | None = None) -> dict[str, Any]:
    """A report as the doctor would write it for ``n`` GPUs called ``name``."""
    cc = "9.0" if "H100" in name else "8.9"
    gpu = DeviceKernels("cuda", name, True, True, f"compute capability {cc}")
    return {
        "versions": {"python": "3.11.7", "torch": "2.13.0+cu128", "deepspeed": "0.19.8"},
        "cuda": {"available": True, "torch_cuda": "12.8", "nccl": "2.27.3", "cudnn": 91000, "device_count": n},
        "gpus": [{"index": i, "name": name, "total_memory_gb": 25.3, "compute_capability": cc} for i in range(n)],
        "p2p": [{"src": a, "dst": b, "can_access": p2p_ok} for a in range(n) for b in range(n) if a != b],
        "env": {"DS_ACCELERATOR": None, **(env or {})},
        "deepspeed": _ds_info("cuda"),
        "precision": doctor_checks.precision_report(PRESETS, CPU_BOTH, gpu),
        "op_builds": doctor_checks.build_report(PRESETS, _ds_info("cuda"), ALL_TOOLS),
        "allreduce": {
            "backend": "nccl",
            "world_size": n,
            "size_mb": 64.0,
            "iters": 10,
            "device": "cuda",
            "time_ms": 9.0,
            "algbw_gbps": 7.5,
            "busbw_gbps": 10.0,
            "correct": True,
        },
        "disk": {
            "path": "runs",
            "checked": "/data",
            "free_gb": 900.0,
            "total_gb": 2000.0,
            "model": None,
            "n_params": None,
            "checkpoint_gb": None,
        },
    }


RTX4090 = "NVIDIA GeForce RTX 4090"


@pytest.fixture(scope="module")
def machine_report() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "deepzero.doctor", "--json", "--bandwidth-mb", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_doctor_json_on_this_machine(machine_report: dict[str, Any]) -> None:
    """The real report: what it says about GPUs, NCCL and the accelerator follows this machine (CPU or CUDA)."""
    from deepspeed.accelerator import get_accelerator

    report = machine_report
    for package in ("python", "torch", "deepspeed", "transformers", "accelerate"):
        assert report["versions"][package], package
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(report["gpus"]) == n_gpus and len(report["p2p"]) == n_gpus * (n_gpus - 1)
    assert report["cuda"]["available"] is torch.cuda.is_available()
    accelerator = get_accelerator().device_name()
    assert report["deepspeed"]["accelerator"] == accelerator
    assert isinstance(report["deepspeed"]["stale_build_locks"], list)
    assert "DS_ACCELERATOR" in report["env"]
    ar = report["allreduce"]
    backend, world = ("nccl", min(n_gpus, doctor_checks.MAX_GPU_PROCS)) if n_gpus >= 2 else ("gloo", 2)
    assert ar["backend"] == backend and ar["world_size"] == world and ar["correct"] is True
    assert ar["algbw_gbps"] > 0 and ar["busbw_gbps"] > 0
    assert report["disk"]["free_gb"] > 0
    assert any("gloo" in tip for tip in report["advice"]) is (n_gpus == 0)
    p = report["precision"]
    assert p["cpu"]["device"] == "cpu" and p["device"]["device"] == accelerator
    assert [row["preset"] for row in p["presets"]] == [
        f"ds_configs/{f.name}" for f in sorted(ROOT.glob("ds_configs/*.json"))
    ]
    assert all("dtype" in row or "error" in row for row in p["presets"])
    assert [row["preset"] for row in report["op_builds"]["presets"]] == [row["preset"] for row in p["presets"]]


def test_advice_3x4090_without_p2p() -> None:
    tips = doctor.advice(_report(RTX4090, 3, p2p_ok=False))
    assert doctor.P2P_ADVICE in tips
    assert "NCCL_P2P_DISABLE=1" in doctor.P2P_ADVICE and "NCCL_IB_DISABLE=1" in doctor.P2P_ADVICE


def test_advice_3x4090_already_set() -> None:
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    tips = doctor.advice(_report(RTX4090, 3, p2p_ok=False, env=env))
    assert not any("NCCL_P2P_DISABLE" in tip for tip in tips)


def test_advice_h100_nvlink_is_clean() -> None:
    assert doctor.advice(_report("NVIDIA H100 80GB HBM3", 8, p2p_ok=True)) == []


def test_advice_hung_allreduce_on_4090_points_at_p2p() -> None:
    report = _report(RTX4090, 3, p2p_ok=True)  # an old driver that claims P2P works on GeForce
    report["allreduce"] = {"backend": "nccl", "world_size": 3, "error": "timed out after 120 s"}
    tips = doctor.advice(report)
    assert any(tip.startswith("all-reduce test failed") and "NCCL_P2P_DISABLE=1" in tip for tip in tips)
    report["p2p"] = [{**pair, "can_access": False} for pair in report["p2p"]]
    assert sum(doctor.P2P_ADVICE in tip for tip in doctor.advice(report)) == 1  # said once, not twice


def test_advice_low_disk() -> None:
    report = _report(RTX4090, 3, p2p_ok=False, env={"NCCL_P2P_DISABLE": "1"})
    report["disk"].update(free_gb=30.0, model="deepseek-coder-1.3b", checkpoint_gb=18.9)
    assert any(tip.startswith("low disk") and "deepseek-coder-1.3b" in tip for tip in doctor.advice(report))
    report["disk"].update(free_gb=5.0, model=None, checkpoint_gb=None)
    assert any(tip.startswith("low disk") and "10 GB" in tip for tip in doctor.advice(report))


def test_advice_cpu_only_and_ops() -> None:
    report = _report(RTX4090, 0, p2p_ok=False)
    report["deepspeed"]["ops_incompatible"] = ["async_io", "evoformer_attn"]
    tips = doctor.advice(report)
    assert any("gloo" in tip for tip in tips)
    assert any("async_io" in tip and "evoformer" not in tip for tip in tips)


def test_advice_stale_op_build_lock() -> None:
    report = _report(RTX4090, 3, p2p_ok=True)
    report["deepspeed"]["stale_build_locks"] = ["/root/.cache/torch_extensions/py311_cu128/fused_adam/lock"]
    assert "rm /root/.cache/torch_extensions/py311_cu128/fused_adam/lock" in "\n".join(doctor.advice(report))


def test_render_text_3x4090() -> None:
    report = _report(RTX4090, 3, p2p_ok=False)
    report["advice"] = doctor.advice(report)
    text = doctor.render_text(report)
    assert "RTX 4090" in text and "busbw" in text and doctor.P2P_ADVICE in text


def test_bad_model_is_a_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--model", "no-such-model", "--bandwidth-mb", "0"]) == 2
    assert "Fix:" in capsys.readouterr().err


def test_allreduce_bench_reports_a_failing_rank() -> None:
    import torch.distributed as dist

    # Without NCCL every rank fails at init; where NCCL works, an unknown backend fails the same way on any machine.
    backend = "no-such-backend" if dist.is_nccl_available() else "nccl"
    result = doctor_checks.allreduce_bench(1, backend, 2, timeout_s=60)
    assert backend in result["error"].lower() and "busbw_gbps" not in result


def _rows(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["preset"]: row for row in section["presets"]}


def _cpu_report(kernels: DeviceKernels) -> dict[str, Any]:
    """A report of a box whose ranks train on this CPU, with the advice and text the doctor prints for it."""
    report = _report(RTX4090, 0, p2p_ok=False)
    report["deepspeed"] = _ds_info("cpu")
    report["precision"] = doctor_checks.precision_report(PRESETS, kernels, kernels)
    report["op_builds"] = doctor_checks.build_report(PRESETS, _ds_info("cpu"), ALL_TOOLS)
    report["advice"] = doctor.advice(report)
    return report


def test_presets_cover_fp16_bf16_torch_adam_and_offload() -> None:
    """The fabricated-report tests below mean something only while ds_configs has each kind of preset."""
    rows = _rows(doctor_checks.precision_report(PRESETS, CPU_BOTH, T4))
    requested = {name: row["requested"] for name, row in rows.items()}
    assert requested["ds_configs/zero2.json"] == "fp16" and "bf16" in requested.values()
    ops = {name: preset_ops(cfg) for name, cfg in PRESETS.items()}
    assert ops["ds_configs/zero2.json"] == [] and ops["ds_configs/zero2_offload.json"] == ["cpu_adam"]


def test_cpu_without_16bit_kernels_trains_presets_in_fp32() -> None:
    report = _cpu_report(CPU_NONE)
    rows = _rows(report["precision"])
    assert rows["ds_configs/zero2.json"]["requested"] == "fp16" and rows["ds_configs/zero2.json"]["dtype"] == "fp32"
    bf16 = [name for name, row in rows.items() if row["requested"] == "bf16"]
    assert bf16 and all(rows[name]["dtype"] == "fp32" for name in bf16)
    (tip,) = [tip for tip in report["advice"] if "--precision" in tip]
    assert "Old Xeon" in tip and "ds_configs/zero2.json" in tip and all(name in tip for name in bf16)
    assert "emulated" in tip and "fp16" not in tip.split("--precision")[1]  # fp16 cannot be forced here
    text = doctor.render_text(report)
    assert "Old Xeon: native fp32 only" in text and "fp32, not the fp16 it asks for" in text


def test_cpu_with_16bit_kernels_keeps_preset_types() -> None:
    report = _cpu_report(CPU_BOTH)
    for row in report["precision"]["presets"]:
        assert row["dtype"] == row["requested"], row
    assert not any("--precision" in tip for tip in report["advice"])
    assert "Sapphire Rapids: native fp16 and bf16" in doctor.render_text(report)


def test_gpu_without_bf16_cannot_run_bf16_presets() -> None:
    report = _report("Tesla T4", 1, p2p_ok=True)
    report["gpus"][0]["compute_capability"] = "7.5"
    # the CPU probe is reported on a GPU box too
    report["precision"] = doctor_checks.precision_report(PRESETS, CPU_NONE, T4)
    rows = _rows(report["precision"])
    assert rows["ds_configs/zero2.json"]["dtype"] == "fp16"
    bf16 = [row for row in rows.values() if row["requested"] == "bf16"]
    assert bf16 and all("dtype" not in row and "cannot train in bf16" in row["error"] for row in bf16)
    report["advice"] = doctor.advice(report)
    assert not any("--precision" in tip for tip in report["advice"])  # that tip is for CPU training only
    text = doctor.render_text(report)
    assert "Old Xeon: native fp32 only" in text and "trains on" in text and "cuda, Tesla T4" in text
    assert text.count("cannot run: Tesla T4") == len(bf16)


def test_collect_reports_the_probed_cpu_and_training_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(doctor_checks.precision, "probe", lambda: T4)
    monkeypatch.setattr(doctor_checks.precision, "probe_cpu", lambda: CPU_BOTH)
    report = doctor_checks.collect(0, str(tmp_path), None)
    assert (
        report["precision"]["cpu"]["name"] == "Sapphire Rapids" and report["precision"]["device"]["name"] == "Tesla T4"
    )
    assert len(report["precision"]["presets"]) == len(PRESETS) == len(report["op_builds"]["presets"])


def test_op_builds_per_preset() -> None:
    torch_adam = [name for name, cfg in PRESETS.items() if cfg["optimizer"]["params"].get("torch_adam") is True]
    offload = [n for n, c in PRESETS.items() if c["zero_optimization"].get("offload_optimizer", {}).get("device")]
    assert torch_adam and offload and not set(torch_adam) & set(offload)
    bare = _rows(doctor_checks.build_report(PRESETS, _ds_info("cpu"), NO_TOOLS))
    for name in torch_adam:  # on the CPU, DeepSpeed's shared-memory collectives still compile
        assert bare[name]["ops"] == ["deepspeed_shm_comm"] and bare[name]["missing"] == [JIT_TOOLS["c++"]], name
    for name in offload:
        assert bare[name]["build"] == ["cpu_adam", "deepspeed_shm_comm"], name
        assert bare[name]["missing"] == [JIT_TOOLS["c++"]], name
        assert (
            doctor._build_cell(bare[name])
            == "cpu_adam, deepspeed_shm_comm, compiled on first use with c++: missing: a C++ compiler (c++ or g++)"
        )
    cuda_bare = _rows(doctor_checks.build_report(PRESETS, _ds_info("cuda"), NO_TOOLS))
    for name in torch_adam:  # a CUDA box with pip's torch and no toolkit: nothing to compile
        assert cuda_bare[name]["ops"] == [] and cuda_bare[name]["missing"] == [], name
    cuda = _rows(doctor_checks.build_report(PRESETS, _ds_info("cuda"), {"c++": "/usr/bin/g++", "nvcc": None}))
    assert all(cuda[name]["missing"] == [JIT_TOOLS["nvcc"]] for name in offload)
    assert all(doctor._build_cell(cuda[name]).endswith(": ok") for name in torch_adam)
    prebuilt = _rows(doctor_checks.build_report(PRESETS, _ds_info("cuda", ops_prebuilt=["cpu_adam"]), NO_TOOLS))
    assert all(prebuilt[name]["build"] == [] and prebuilt[name]["missing"] == [] for name in offload)


def test_preset_ops_follow_deepspeeds_choice() -> None:
    adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
    assert preset_ops(adam) == ["fused_adam"]
    row = doctor_checks.preset_build("x.json", adam, {"c++": "/usr/bin/c++", "nvcc": None}, _ds_info("cuda"))
    assert row["tools"] == ["c++", "nvcc"] and row["missing"] == [JIT_TOOLS["nvcc"]]
    offloaded = {**adam, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    assert preset_ops(offloaded) == ["cpu_adam"]
    torch_adam = {**offloaded, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert preset_ops(torch_adam) == []  # DeepSpeed checks torch_adam before offload
    assert preset_ops(torch_adam, "cpu") == ["deepspeed_shm_comm"]
    broken = doctor_checks.preset_build("x.json", adam, ALL_TOOLS, _ds_info("cuda", ops_incompatible=["fused_adam"]))
    assert broken["missing"] == ["fused_adam, which DeepSpeed cannot build here"]


def test_toolchain_finds_nvcc_in_cuda_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert doctor_checks.toolchain() == {"c++": None, "nvcc": str(nvcc)}
    monkeypatch.delenv("CUDA_HOME")
    assert doctor_checks.toolchain()["nvcc"] is None


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shell_syntax(path: Path) -> None:
    assert path.is_file()
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_single_node_dry_run_from_other_cwd(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "NUM_GPUS": "2"}
    proc = subprocess.run(
        [str(LAUNCH / "single_node.sh"), "--max-steps", "3"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert f"cd {ROOT} && deepspeed --num_gpus=2" in proc.stdout
    assert "train.py --deepspeed_config ds_configs/zero2.json --max-steps 3" in proc.stdout


def test_multi_node_no_ssh_needs_node_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    proc = subprocess.run(
        [str(LAUNCH / "multi_node.sh"), "--no_ssh"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr


def test_env_4090_exports() -> None:
    out = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {LAUNCH / 'env_4090.sh'}; env"],
        env={k: v for k, v in os.environ.items() if not k.startswith("NCCL_")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for line in ("NCCL_P2P_DISABLE=1", "NCCL_IB_DISABLE=1", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        assert line in out


def test_accelerate_yaml() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(LAUNCH / "accelerate_deepspeed.yaml"))
    assert config.distributed_type == "DEEPSPEED" and config.num_processes == 3
    ds_file = config.deepspeed_config["deepspeed_config_file"]
    assert ds_file.startswith("ds_configs/") and ds_file.endswith(".json")
