"""`python train.py --device-map balanced`: one process, layers split over cards (here "cpu" cards)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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
