"""The long-sequence savers (issue 23) change memory, not the math: offloaded checkpoints and the tiled MLP give
the same gradients as the plain model (fp32, in-process, every family); through train.py the tiled loss trains
ZeRO-3 (LM head gathered by its own hooks) exactly as the untiled loss does, the choice is in the header and
run_config.json, and a run resumed with every saver on continues the curve of one that never stopped."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import launch, losses
from test_pipeline import tiny_models
from test_tiled_loss import assert_same, batches, loss_and_grads, tiny

from deepzero.losses import TiledLoss
from deepzero.memory_savers import MemorySavers, is_mlp


@pytest.mark.parametrize("family", list(tiny_models()))
def test_offloaded_checkpoints_and_tiled_mlp_give_the_plain_gradients(family: str) -> None:
    plain = tiny(family)
    saved = MemorySavers(TiledLoss(False), offload_checkpoints=True, mlp_tiles=3).apply(copy.deepcopy(plain))
    assert saved.is_gradient_checkpointing
    assert sum(is_mlp(m) for m in saved.modules()) >= 1
    micro = batches(plain.config.vocab_size)
    assert_same(loss_and_grads(plain, micro), loss_and_grads(saved, micro))


def test_offload_moves_the_checkpointed_hidden_states_off_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each checkpointed layer's input goes through torch's save_on_cpu copy: one [micro, seq, hidden] tensor per
    decoder layer (recorded by wrapping save_on_cpu's pack hook)."""
    seen: list[tuple[int, ...]] = []

    class Recording(torch.autograd.graph.save_on_cpu):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, **kw)
            pack = self.pack_hook
            self.pack_hook = lambda t: (seen.append(tuple(t.shape)), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    model = MemorySavers(TiledLoss(False), offload_checkpoints=True).apply(tiny("llama"))
    model(**batches(128)[0], use_cache=False).loss.backward()
    assert seen.count((2, 40, model.config.hidden_size)) == model.config.num_hidden_layers


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--deepspeed_config", "ds_configs/zero3.json", "--model", "tiny-deepseek-v3", "--data", str(data),
        "--out", str(out), "--precision", "fp32", "--lr", "3e-3", "--warmup-steps", "2", "--micro-batch", "2",
        "--grad-accum", "1", "--log-interval", "1", "--eval-interval", "0", "--save-interval", "2", "--no-export",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """ZeRO-3 on 3 ranks with the defaults (tiled loss), 4 steps."""
    out = tmp_path_factory.mktemp("long") / "tiled"
    proc = launch(args(tiny_data, out, "--max-steps", "4"))
    return out, proc.stdout + proc.stderr


@pytest.mark.launcher
def test_zero3_trains_the_same_with_and_without_the_tiled_loss(
    uninterrupted: tuple[Path, str], tiny_data: Path, tmp_path: Path
) -> None:
    tiled, log = uninterrupted
    assert "loss: tiled over the LM head (4 token tiles per micro-batch" in log
    recorded = json.loads((tiled / "run_config.json").read_text())["memory_savers"]
    assert recorded == {
        "loss": {"enabled": True, "tiles_per_vocab": 4, "min_tile_rows": 256},
        "offload_checkpoints": False,
        "mlp_tiles": 0,
    }
    untiled = tmp_path / "untiled"
    proc = launch(args(tiny_data, untiled, "--max-steps", "2", "--tiled-loss", "off"))
    assert "loss: untiled" in proc.stdout
    a, b = losses(tiled), losses(untiled)
    assert b[1] == pytest.approx(a[1], rel=1e-5) and b[2] == pytest.approx(a[2], rel=1e-5)


@pytest.mark.launcher
def test_a_resume_with_every_saver_on_continues_the_curve(
    uninterrupted: tuple[Path, str], tiny_data: Path, tmp_path: Path
) -> None:
    tiled, _ = uninterrupted
    out = tmp_path / "saved"
    launch(args(tiny_data, out, "--max-steps", "2"))
    extra = ["--gradient-checkpointing", "--activation-offload", "--tiled-mlp", "3", "--resume"]
    proc = launch(args(tiny_data, out, "--max-steps", "4", *extra))
    assert "checkpointed hidden states in host memory; MLP in 3 sequence tiles" in proc.stdout
    a, b = losses(tiled), losses(out)
    assert [b[s] for s in (3, 4)] == pytest.approx([a[s] for s in (3, 4)], rel=1e-5)
