"""The long-sequence savers (issue 23) change memory, not the math: offloaded checkpoints and the tiled MLP give
the same gradients as the plain model (fp32, in-process, every family); through train.py the tiled loss trains
ZeRO-3 (LM head gathered by its own hooks) exactly as the untiled loss does, the choice is in the header and
run_config.json, and a run resumed with every saver on continues the curve of one that never stopped."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import launch, losses
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import tiny_models
from test_tiled_loss import assert_same, batches, loss_and_grads, tiny

from deepzero.losses import TiledLoss
from deepzero.memory_savers import MemorySavers, is_mlp, tile_mlps


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


def choose_tiles(tokens: int, asked: str, hidden: int = 64) -> MemorySavers:
    flags = SimpleNamespace(
        activation_offload=False, gradient_checkpointing=False, device_map=None, tiled_loss="off", tiled_mlp=asked
    )
    return MemorySavers.choose(flags, SimpleNamespace(vocab_size=128, hidden_size=hidden), tokens, pipeline=False)


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 70_000), asked=st.integers(1, 5_000), hidden=st.integers(1, 4_096))
def test_the_mlp_tile_count_is_the_one_torch_chunk_makes(tokens: int, asked: int, hidden: int) -> None:
    """DeepSpeed's TiledMLP marks the gradients ready for ZeRO only after backward's piece number ``shards``; when
    torch.chunk makes fewer pieces (4,096 tokens in 1,000 tiles: 820 pieces of 5) that piece never comes. So the
    count a run tiles in is the one torch.chunk makes of its rows, for a number and for "on" alike."""
    for flag, wanted in ((str(asked), asked), ("on", math.ceil(tokens / hidden))):
        made = len(torch.chunk(torch.empty(tokens), wanted))
        assert choose_tiles(tokens, flag, hidden).mlp_tiles == (made if made > 1 else 0), (tokens, flag)


def test_a_rounded_tile_count_says_so_in_the_header() -> None:
    savers = choose_tiles(4096, "1000")
    assert savers.mlp_tiles == 820 and len(torch.chunk(torch.empty(4096), 1000)) == 820
    assert "MLP in 820 sequence tiles (1000 asked: torch.chunk cuts a 4,096-token row into 820)" in savers.describe()
    assert "asked" not in choose_tiles(4096, "1024").describe()


@pytest.mark.parametrize(("shape", "tiles"), [((2, 4096, 8), 1000), ((1, 2048, 8), 820), ((2, 3, 8), 5)], ids=str)
def test_a_tile_count_torch_chunk_cannot_make_still_gives_zero_every_gradient(
    shape: tuple[int, int, int], tiles: int
) -> None:
    """Tiles asked of the MLP directly (as a sequence-parallel piece of a row gets them: 820 tiles fit 4,096 tokens,
    not 2,048): the count handed to TiledMLP is the one torch.chunk makes of the call's rows, so its backward marks
    every parameter ready for ZeRO at its last piece (``ds_grad_is_ready``, which ZeRO's gradient hooks wait for),
    and the gradients are the untiled MLP's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    plain = torch.nn.ModuleList([LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2))])
    tiled = copy.deepcopy(plain)
    assert tile_mlps(tiled, tiles) == 1
    x = torch.randn(shape)
    grads = []
    for model in (plain, tiled):
        inp = x.clone().requires_grad_()
        model[0](inp).square().sum().backward()
        grads.append({"input": inp.grad, **{n: p.grad for n, p in model.named_parameters()}})
    assert all(getattr(p, "ds_grad_is_ready", None) is True for p in tiled.parameters())
    for name, grad in grads[0].items():  # fp32 sums in another order: within 1e-5 of the largest entry
        assert (grads[1][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


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
