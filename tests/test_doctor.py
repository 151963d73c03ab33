"""The environment doctor (a real run on this CPU machine, advice on fabricated reports) and the launch files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deepzero import doctor

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SHELL_NAMES = {"env_4090.sh", "single_node.sh", "multi_node.sh", "torchrun.sh", "slurm.sbatch"}
SHELL_FILES = sorted({*(LAUNCH / n for n in SHELL_NAMES), *LAUNCH.glob("*.sh")})


def _report(name: str, n: int, p2p_ok: bool, env: dict[str, str | None] | None = None) -> dict[str, Any]:
    """A report as the doctor would write it for ``n`` GPUs called ``name``."""
    cc = "9.0" if "H100" in name else "8.9"
    return {
        "versions": {"python": "3.11.7", "torch": "2.13.0+cu128", "deepspeed": "0.19.8"},
        "cuda": {"available": True, "torch_cuda": "12.8", "nccl": "2.27.3", "cudnn": 91000, "device_count": n},
        "gpus": [{"index": i, "name": name, "total_memory_gb": 25.3, "compute_capability": cc} for i in range(n)],
        "p2p": [{"src": a, "dst": b, "can_access": p2p_ok} for a in range(n) for b in range(n) if a != b],
        "env": {"DS_ACCELERATOR": None, **(env or {})},
        "deepspeed": {"accelerator": "cuda", "ninja": True, "ops_incompatible": []},
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
def cpu_report() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "deepzero.doctor", "--json", "--bandwidth-mb", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_doctor_json_on_cpu(cpu_report: dict[str, Any]) -> None:
    for package in ("python", "torch", "deepspeed", "transformers", "accelerate"):
        assert cpu_report["versions"][package], package
    assert cpu_report["gpus"] == [] and cpu_report["p2p"] == []
    assert cpu_report["deepspeed"]["accelerator"] == "cpu"
    assert isinstance(cpu_report["deepspeed"]["stale_build_locks"], list)
    assert "DS_ACCELERATOR" in cpu_report["env"]
    ar = cpu_report["allreduce"]
    assert ar["backend"] == "gloo" and ar["world_size"] == 2 and ar["correct"] is True
    assert ar["algbw_gbps"] > 0 and ar["busbw_gbps"] > 0
    assert cpu_report["disk"]["free_gb"] > 0
    assert any("gloo" in tip for tip in cpu_report["advice"])


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
    result = doctor.allreduce_bench(1, "nccl", 2, timeout_s=60)  # this torch has no NCCL: every rank fails at init
    assert "NCCL" in result["error"] and "busbw_gbps" not in result


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
