"""Document-masked packing: a packed row whose ``position_ids`` restart at each document gives the logits and the
loss of its documents run one at a time — in the plain model (what the ZeRO engine runs), through the pipeline
stages (positions cross the stages) and through the layer split (issue 15). Transformers builds the block-diagonal
causal mask from the positions; nothing here writes attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_pipeline import tiny_models
from transformers import AutoModelForCausalLM

from deepzero.engines.layer_split import LayerSplitEngine, place_model
from deepzero.engines.pipeline import sequential_forward, to_pipeline_layers
from deepzero.losses.lm import lm_loss, loss_normalizer

LENGTHS = (7, 12, 5)
"""Three documents in one row of 24 tokens."""
ATOL = 2e-5


def documents(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, n), generator=gen) for n in LENGTHS]


def packed(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The row as the dataset yields it: positions restart per document; no target across a document end."""
    ids = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    labels = torch.cat([shifted(d) for d in docs], dim=1)
    return {"input_ids": ids, "labels": labels, "shift_labels": labels, "position_ids": positions}


def shifted(doc: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one document; its last position has none (-100)."""
    return torch.cat([doc[:, 1:], torch.full((1, 1), -100)], dim=1)


def alone(doc: torch.Tensor) -> dict[str, torch.Tensor]:
    labels = shifted(doc)
    return {"input_ids": doc, "labels": labels, "shift_labels": labels}


def model_of(family: str, attn: str) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_models()[family], dtype=torch.float32, attn_implementation=attn).eval()


def separate_logits(run: Any, docs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([run(d) for d in docs], dim=1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(tiny_models()))
@torch.no_grad()
def test_packed_row_equals_its_documents_one_at_a_time(family: str, attn: str) -> None:
    model, docs = model_of(family, attn), documents()
    row = packed(docs)
    logits = model(**row, use_cache=False).logits
    expected = separate_logits(lambda d: model(input_ids=d, use_cache=False).logits, docs)
    assert torch.allclose(logits, expected, atol=ATOL), (logits - expected).abs().max()
    stream = model(input_ids=row["input_ids"], use_cache=False).logits  # one sequence: later documents see earlier
    assert (stream[:, LENGTHS[0] :] - expected[:, LENGTHS[0] :]).abs().max() > 1e-3
    # The loss: the token mean over all documents' targets, as the engines compute it (lm_loss).
    loss = lm_loss(model, row, loss_normalizer([row], dp_size=1))
    sums = [lm_loss(model, alone(d), torch.ones(())) for d in docs]
    assert loss.item() == pytest.approx(sum(sums).item() / sum(n - 1 for n in LENGTHS), abs=ATOL)


@pytest.mark.parametrize("family", list(tiny_models()))
@torch.no_grad()
def test_positions_cross_the_pipeline_stages(family: str) -> None:
    model, docs = model_of(family, "sdpa"), documents(1)
    layers = to_pipeline_layers(model)
    row = packed(docs)
    logits = sequential_forward(layers, row["input_ids"], row["position_ids"])
    expected = separate_logits(lambda d: sequential_forward(layers, d), docs)
    assert torch.allclose(logits, expected, atol=ATOL), (logits - expected).abs().max()


@torch.no_grad()
def test_the_layer_split_masks_documents_too() -> None:
    model, docs = model_of("deepseek_v3", "sdpa"), documents(2)
    ds = {"gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = LayerSplitEngine(model, place_model(model, ["cpu", "cpu"], seq_len=sum(LENGTHS), micro_batch=1), ds)
    logits = engine(**packed(docs), use_cache=False).logits
    expected = separate_logits(lambda d: engine(input_ids=d, use_cache=False).logits, docs)
    assert torch.allclose(logits.cpu(), expected.cpu(), atol=ATOL), (logits.cpu() - expected.cpu()).abs().max()


def test_a_micro_batch_without_targets_is_harmless() -> None:
    """A chat row can hold no assistant token: its micro-batch adds 0 to the loss and nothing to the gradient
    (a per-micro-batch mean would be 0/0 = NaN there)."""
    model, docs = model_of("llama", "sdpa"), documents(3)
    empty = {**packed(docs), "labels": torch.full((1, sum(LENGTHS)), -100)}
    empty["shift_labels"] = empty["labels"]
    full = packed(docs)
    normalizer = loss_normalizer([empty, full], dp_size=1)
    assert normalizer.item() == sum(n - 1 for n in LENGTHS) / 2
    loss = lm_loss(model.train(), empty, normalizer)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert torch.isfinite(lm_loss(model, full, normalizer))
