"""`python train.py --device-map balanced`: one process, layers split over cards (here "cpu" cards)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_env, losses, records, run_bounded

ARGS = ["--ds", "fp16.enabled=false", "train_batch_size=auto", "--max-steps", "6", "--lr", "3e-3"]
ARGS += ["--warmup-steps", "2", "--micro-batch", "2", "--grad-accum", "2", "--log-interval", "1"]
ARGS += ["--eval-interval", "3", "--eval-batches", "2", "--save-interval", "3"]


def train(data: Path, out: Path, cards: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    devices = ",".join(["cpu"] * cards)
    cmd = [sys.executable, "train.py", "--device-map", "balanced", "--device-map-devices", devices]
    cmd += ["--data", str(data), "--out", str(out), *ARGS, *extra]
    return run_bounded(cmd, 600, env)


@pytest.fixture(scope="module")
def three_cards(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("split") / "run"
    proc = train(tiny_data, out, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_split_over_three_cards_prints_the_table_and_matches_the_unsplit_model(
    three_cards: tuple[Path, str], tiny_data: Path, tmp_path: Path
) -> None:
    out, stdout = three_cards
    assert "4 layers over 3 cards" in stdout and "layer split over 3 cards" in stdout
    table = [line for line in stdout.splitlines() if line[:1] in "012" and " cpu " in line]
    assert len(table) == 3 and "embed" in table[0] and "lm_head" in table[2]
    proc = train(tiny_data, tmp_path / "one", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split, whole = losses(out), losses(tmp_path / "one")
    assert split == pytest.approx(whole, abs=1e-6) and split[6] < split[1]
    assert records(out, "export")[-1]["ok"] and records(out, "eval")


def test_split_resume_continues_the_curve(three_cards: tuple[Path, str], tiny_data: Path, tmp_path: Path) -> None:
    out, _ = three_cards
    again = tmp_path / "again"
    shutil.copytree(out, again)
    (again / "checkpoints" / "latest").write_text("step00000003")
    (again / "metrics.jsonl").unlink()
    proc = train(tiny_data, again, 3, "--resume", "--no-export")
    assert proc.returncode == 0 and "resumed from step 3" in proc.stdout, proc.stderr[-3000:]
    resumed, full = losses(again), losses(out)
    assert {s: resumed[s] for s in (4, 5, 6)} == pytest.approx({s: full[s] for s in (4, 5, 6)}, abs=1e-6)


def test_split_under_a_multi_rank_launcher_is_refused(tiny_data: Path, tmp_path: Path) -> None:
    proc = train(tiny_data, tmp_path / "x", 3, env=cpu_env(WORLD_SIZE="3"))
    assert proc.returncode == 2
    assert "error: --device-map: layer split runs in one process, not 3" in proc.stderr


def test_a_bf16_update_keeps_fp32_master_weights_like_the_zero_engine(tiny_data: Path, tmp_path: Path) -> None:
    """One bf16 update at a fine-tuning lr (1.5e-5) on the same batches: the layer split's fp32 master weights move
    as the ZeRO-2 engine's do. Stepping the bf16 weights directly would round most of that update away (a bf16 ulp
    at 0.02 is 1.2e-4). The two forwards differ by bf16 rounding noise (different kernels' order), so the updates
    are compared as vectors, not bit for bit."""
    from conftest import launch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    common = ["--deepspeed_config", "ds_configs/zero2_bf16.json", "--precision", "bf16", "--data", str(tiny_data)]
    common += ["--max-steps", "3", "--warmup-steps", "1", "--lr", "3e-5", "--micro-batch", "2", "--grad-accum", "1"]
    common += ["--eval-interval", "0", "--no-export", "--save-interval", "1", "--keep-last", "3"]
    split = tmp_path / "split"  # warm-up: steps 1-2 run at lr 0 (the masters stay at their start), step 3 at 1.5e-5
    cmd = [sys.executable, "train.py", "--device-map", "balanced", "--device-map-devices", "cpu,cpu"]
    proc = run_bounded([*cmd, *common, "--out", str(split)], 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launch([*common, "--out", str(tmp_path / "zero")], nproc=1)

    def ours(step: int) -> dict[str, torch.Tensor]:
        path = split / "checkpoints" / f"step{step:08d}" / "layer_split_states.pt"
        return torch.load(path, weights_only=True)["masters"]

    def theirs(step: int) -> dict[str, torch.Tensor]:
        return get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "zero" / "checkpoints"), tag=f"step{step:08d}")

    start, end, zero_start, zero_end = ours(1), ours(3), theirs(1), theirs(3)
    assert all(v.dtype == torch.float32 for v in end.values()) and end.keys() <= zero_end.keys()
    for name in start:
        torch.testing.assert_close(start[name], zero_start[name], rtol=0, atol=0, msg=name)  # same start, bit for bit
    ours_update = torch.cat([(end[n] - start[n]).flatten() for n in start])
    zero_update = torch.cat([(zero_end[n] - zero_start[n]).flatten() for n in start])
    assert (ours_update != 0).float().mean() > 0.9  # nearly every weight moved, by far less than a bf16 ulp
    assert torch.nn.functional.cosine_similarity(ours_update, zero_update, dim=0) > 0.9
    assert ours_update.norm().item() == pytest.approx(zero_update.norm().item(), rel=0.05)


def test_fp16_is_refused_with_one_line(tiny_data: Path, tmp_path: Path) -> None:
    from conftest import fake_cpu_vars  # a CPU with native fp16, so the precision decision lets fp16 through

    proc = train(tiny_data, tmp_path / "x", 2, "--precision", "fp16", env=cpu_env(**fake_cpu_vars("fp16")))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --device-map: the layer split trains in bf16 or fp32 (fp32 master weights); fp16 would need loss"
        " scaling. Fix: pass --precision bf16 or --precision fp32"
    ], proc.stderr[-2000:]
