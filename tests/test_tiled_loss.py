"""The tiled LM loss (issue 23): loss and every parameter's gradient equal the untiled computation (fp32), for
Llama, Qwen2, DeepSeek-V2 and V3, on packed documents with chat-style masks and on a micro-batch without targets;
through the model (what the ZeRO engines run), LoRA and the layer split. The ZeRO-3 path (weight gathered by the
LM head's own hooks) runs through train.py in test_train_e2e-style launches (tests/test_long_sequences.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_pipeline import tiny_models
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from deepzero.adapters.lora import LoraSpec, apply_lora
from deepzero.engines.layer_split import LayerSplitEngine, place_model
from deepzero.engines.pipeline import TokenMeanLoss, sequential_forward, to_pipeline_layers
from deepzero.losses import TiledLoss, install_tiled_loss
from deepzero.losses.lm import lm_loss, loss_normalizer

REL = 1e-5


def batches(vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches: packed documents (positions restart) whose first tokens are prompt (-100) as in chat
    rows, and one micro-batch with no target at all."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 40), generator=gen)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    labels = torch.randint(0, vocab, (2, 40), generator=gen)
    labels[:, :6] = -100  # a prompt
    labels[:, 14] = -100  # no target across the document end
    labels[:, 15:20] = -100  # the second conversation's prompt
    labels[1, 30:] = -100
    none = {"input_ids": ids[:1], "labels": torch.full((1, 40), -100), "position_ids": positions[:1]}
    none["shift_labels"] = none["labels"]
    return [{"input_ids": ids, "labels": labels, "shift_labels": labels, "position_ids": positions}, none]


def loss_and_grads(model: Any, micro: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    getattr(model, "model", model).zero_grad(set_to_none=True)
    normalizer = loss_normalizer(micro, dp_size=1)
    total = 0.0
    for batch in micro:
        loss = lm_loss(model, batch, normalizer)
        loss.backward()
        total += loss.item()
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else []
    grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    return total, grads


def assert_same(ref: tuple[float, dict], got: tuple[float, dict]) -> None:
    assert got[0] == pytest.approx(ref[0], rel=REL)
    assert sorted(got[1]) == sorted(ref[1])
    for name, grad in ref[1].items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert (got[1][name] - grad).abs().max() <= REL * scale + 1e-9, name


def tiny(family: str) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_models()[family], dtype=torch.float32).train()


@pytest.mark.parametrize("family", list(tiny_models()))
def test_tiled_loss_and_gradients_equal_the_untiled_model(family: str) -> None:
    plain = tiny(family)
    tiled = install_tiled_loss(copy.deepcopy(plain), TiledLoss(True, 7, min_tile_rows=1))
    micro = batches(plain.config.vocab_size)
    ref, got = loss_and_grads(plain, micro), loss_and_grads(tiled, micro)
    assert ref[0] > 0
    assert_same(ref, got)
    assert tiled(**micro[0], use_cache=False).logits is None  # the tiled path ran: no logits were made


def test_the_layer_split_trains_with_the_tiled_loss() -> None:
    plain = tiny("deepseek_v3")
    tiled = install_tiled_loss(copy.deepcopy(plain), TiledLoss(True, 6, min_tile_rows=1))
    ds = {"gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = LayerSplitEngine(tiled, place_model(tiled, ["cpu", "cpu"], seq_len=40, micro_batch=2), ds)
    micro = batches(128)
    got = loss_and_grads(engine, micro)
    assert_same(loss_and_grads(plain, micro), (got[0], {n: p.grad for n, p in tiled.named_parameters()}))


def test_a_micro_batch_without_targets_adds_zero_loss_and_no_gradient() -> None:
    model = install_tiled_loss(tiny("llama"), TiledLoss(True, 3, min_tile_rows=1))
    empty = batches(128)[1]
    loss, grads = loss_and_grads(model, [empty])
    assert loss == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_without_labels_the_model_returns_its_logits() -> None:
    plain = tiny("deepseek_v3").eval()
    tiled = install_tiled_loss(copy.deepcopy(plain), TiledLoss(True, 5, min_tile_rows=1))
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(tiled(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_lora_gradients_equal_the_untiled_lora_model() -> None:
    spec = LoraSpec.parse("r=4,alpha=8,targets=attn,mlp")
    plain = apply_lora(tiny("deepseek_v2"), spec)
    torch.manual_seed(1)
    for p in plain.parameters():  # LoRA's B starts at zero: move it so that A's gradient is not zero too
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    tiled = copy.deepcopy(plain)
    install_tiled_loss(tiled.get_base_model(), TiledLoss(True, 4, min_tile_rows=1))
    micro = batches(128)
    assert_same(loss_and_grads(plain, micro), loss_and_grads(tiled, micro))


def test_the_choice_follows_vocab_over_hidden() -> None:
    assert TiledLoss.choose("on", 128, 64) == TiledLoss(True, 2)
    assert not TiledLoss.choose("off", 128, 64).enabled
    assert not TiledLoss.choose("on", 64, 64).enabled  # one tile saves nothing


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_sliding"])
def test_the_pipeline_last_stage_tiles_the_loss(family: str) -> None:
    """The stages of a tiled model end in the hidden states; the pipeline's loss runs the LM head over them in
    tiles and gives the untiled stages' loss and gradients (and their logits for the export check)."""
    plain = tiny(family)
    tiled = install_tiled_loss(copy.deepcopy(plain), TiledLoss(True, 3, min_tile_rows=1))
    batch = batches(128)[0]
    normalizer = loss_normalizer([batch], dp_size=1)
    results = []
    for model in (plain, tiled):
        model.zero_grad(set_to_none=True)
        layers = to_pipeline_layers(model)
        output = sequential_forward(layers, batch["input_ids"], batch["position_ids"])
        loss_fn = TokenMeanLoss(layers[-1])
        loss_fn.normalizer = normalizer
        loss = loss_fn(output, batch["shift_labels"])
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        last = output
    assert last.shape[-1] == plain.config.hidden_size  # the tiled stages never made logits
    assert_same(*results)
    with torch.no_grad():
        expected = plain(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        assert torch.allclose(layers[-1].logits(last), expected, atol=1e-5)


def test_tiles_are_never_cut_below_the_minimum_rows() -> None:
    """Each tile reads and writes the whole [V × H] weight gradient: many tiny tiles would be memory-bound."""
    choice = TiledLoss(True, 10)
    assert [choice.tile_rows(n) for n in (5000, 1000, 100, 0)] == [500, 256, 100, 1]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_tiled_row_logps_and_gradients_equal_the_models_own_logits(family: str) -> None:
    """What a preference loss reads (``sequence_logps``): each row's summed target log-probability in tiles of the
    real targets equals the log-softmax of the model's own logits, and so does the gradient of a weighted sum of
    them (rows of one pair pulled in opposite directions), also through LoRA."""
    from deepzero.losses.objectives import sequence_logps

    batch = batches(tiny_models()[family].vocab_size)[0]
    weights = torch.tensor([1.0, -0.5])
    for wrap in (lambda m: m, lambda m: apply_lora(m, LoraSpec.parse("r=4"), verbose=False)):
        plain = wrap(tiny(family))
        with torch.no_grad():  # nonzero adapters, so that LoRA's gradients are not trivially equal
            for name, p in plain.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        tiled = copy.deepcopy(plain)
        base = tiled.get_base_model() if hasattr(tiled, "get_base_model") else tiled
        install_tiled_loss(base, TiledLoss(True, 3, min_tile_rows=1))
        results = []
        for model in (plain, tiled):
            model.zero_grad(set_to_none=True)
            logps, counts = sequence_logps(model, batch)
            (logps * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append(((logps.detach(), counts), grads))
        (ref, ref_counts), ref_grads = results[0]
        (got, got_counts), got_grads = results[1]
        assert torch.equal(ref_counts, got_counts) and float(ref.abs().min()) > 1
        torch.testing.assert_close(got, ref, rtol=REL, atol=1e-6)
        assert_same((0.0, ref_grads), (0.0, got_grads))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_backward_holds_no_vocab_by_hidden_temporary(dtype: torch.dtype) -> None:
    """In bf16/fp16 the weight gradient is accumulated in fp32 vocabulary block by block: no op of the backward
    outputs more elements than one tile's [tile × vocab] logits, except the fp32 accumulator and the result (before,
    each tile made a 16-bit [V × H] product and its fp32 copy); and the gradient equals one whole-vocabulary
    product per tile summed in fp32."""
    from deepzero.tiled_loss import _TiledCrossEntropy

    vocab, hidden, rows, tile = 1000, 16, 12, 4
    x, w, targets = _head_inputs(vocab, hidden, rows, dtype)
    losses = _TiledCrossEntropy.apply(x, w, targets, tile)
    with _Allocations() as seen:
        losses.sum().backward()
    whole = [op for op, n in seen.sizes if n >= vocab * hidden]
    assert whole == ["aten.zeros.default", "aten._to_copy.default"], whole  # the fp32 accumulator, its cast
    assert max(n for op, n in seen.sizes if n < vocab * hidden) <= tile * vocab
    ref = torch.zeros(vocab, hidden)
    for first in range(0, rows, tile):
        logits = (x[first : first + tile] @ w.t()).float()
        d = torch.softmax(logits, -1)
        d[torch.arange(d.shape[0]), targets[first : first + tile]] -= 1
        ref += (d.to(dtype).t() @ x[first : first + tile]).float()
    assert torch.allclose(w.grad.float(), ref.to(dtype).float(), rtol=1e-2, atol=1e-3)
    from deepzero.tiled_loss import vocab_block

    assert vocab_block(tile, vocab, hidden) == 250  # 250 × 16 = 4 × 1000: a block holds what a tile's logits hold


def test_a_frozen_head_allocates_no_weight_gradient() -> None:
    """LoRA's LM head is frozen: the backward allocates nothing of [V × H] (no fp32 accumulator, no cast) and
    gives the hidden states exactly the gradient it gives them when the head trains."""
    from deepzero.tiled_loss import _TiledCrossEntropy

    vocab, hidden, rows, tile = 1000, 16, 12, 4
    x, w, targets = _head_inputs(vocab, hidden, rows, torch.bfloat16)
    _TiledCrossEntropy.apply(x, w, targets, tile).sum().backward()
    trained = x.grad.clone()
    x.grad, w.grad = None, None
    w.requires_grad_(False)
    losses = _TiledCrossEntropy.apply(x, w, targets, tile)
    with _Allocations() as seen:
        losses.sum().backward()
    assert max(n for _, n in seen.sizes) <= tile * vocab and w.grad is None
    assert torch.equal(x.grad, trained)
    loss = TiledLoss(True, 3, min_tile_rows=1)  # the planner's term drops the fp32 accumulator and its 16-bit cast
    frozen, trains = (loss.working_bytes(rows, vocab, hidden, 2, head_trains=t) for t in (False, True))
    assert trains - frozen >= 6 * vocab * hidden


def _head_inputs(vocab: int, hidden: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(dtype).mul(0.1).requires_grad_()
    return x, w, torch.randint(0, vocab, (rows,), generator=gen)


class _Allocations(TorchDispatchMode):
    """The (op, numel) of every tensor the ops run under it allocate (views allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not func.is_view:
                self.sizes.append((str(func), t.numel()))
        return out
