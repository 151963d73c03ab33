"""Layer placement: balanced, contiguous, budget-aware device maps, and a split model that computes the same thing."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from deepzero.errors import UserError
from deepzero.placement import (
    GiB,
    Placement,
    _split,
    find_layers,
    format_placement,
    layer_sizes,
    main,
    meta_model,
    plan_placement,
)
from deepzero.placement_hooks import _to_device, apply_placement
from deepzero.presets import get_preset

MODELS = [
    "tiny-deepseek-v3",
    "tiny-deepseek-v2",
    "deepseek-coder-1.3b",
    "deepseek-r1-distill-qwen-1.5b",
    "deepseek-v2-lite",
]
CARDS_24 = {0: "24GiB", 1: "24GiB", 2: "24GiB"}


def check_layout(placement: Placement, model: torch.nn.Module) -> None:
    """Embed first, norm + lm_head last, every layer exactly once, contiguous, whole, every tensor covered."""
    last = len(placement.cards) - 1
    assert placement.card_of["model.embed_tokens"] == 0
    assert placement.card_of["model.norm"] == last and placement.card_of["lm_head"] == last
    layers_name, layers = find_layers(model)
    layer_keys = [k for k in placement.device_map if k.startswith(layers_name + ".")]
    assert layer_keys == [f"{layers_name}.{i}" for i in range(len(layers))]  # whole layers, each once, in order
    cards = [placement.card_of[k] for k in layer_keys]
    assert cards == sorted(cards)  # contiguous runs
    assert [i for row in placement.cards for i in row.layers] == list(range(len(layers)))
    for row in placement.cards:
        assert all(placement.card_of[f"{layers_name}.{i}"] == row.card for i in row.layers)
    names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    assert all(any(n == k or n.startswith(k + ".") for k in placement.device_map) for n in names)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("training", [False, True])
def test_balanced_map_over_three_cards(name: str, training: bool) -> None:
    config = get_preset(name).config()
    budget = None if (training and name == "deepseek-v2-lite") else CARDS_24  # V2-Lite cannot train in 72 GB
    placement = plan_placement(config, [0, 1, 2], budget, training=training)
    check_layout(placement, meta_model(config))
    assert placement.device_map["model.embed_tokens"] == 0 and placement.device_map["lm_head"] == 2
    totals = [row.total_bytes for row in placement.cards]
    largest_layer = max(v for k, v in layer_sizes(meta_model(config), torch.bfloat16).items() if ".layers." in k)
    step = largest_layer * placement.training_factor + placement.reserve_per_layer_bytes
    if not name.startswith("tiny"):  # real models: every card within about two layers of the others
        assert max(totals) - min(totals) <= 2 * step + placement.cards[-1].reserve_bytes


def test_unequal_budgets_shift_layers_off_the_small_card() -> None:
    config = get_preset("deepseek-coder-1.3b").config()
    even = plan_placement(config, [0, 1, 2], CARDS_24, training=True)
    small = plan_placement(config, [0, 1, 2], {0: "24GiB", 1: "8GiB", 2: "24GiB"}, training=True)
    assert len(small.cards[1].layers) < len(even.cards[1].layers)
    assert len(small.cards[1].layers) < min(len(small.cards[0].layers), len(small.cards[2].layers))
    assert all(row.total_bytes <= row.budget_bytes for row in small.cards)


def test_impossible_budget_says_short_by() -> None:
    config = get_preset("deepseek-v2-lite").config()
    with pytest.raises(UserError, match=r"needs .* GiB but the 3 cards have 72.0 GiB: short by \d+\.\d GiB"):
        plan_placement(config, [0, 1, 2], CARDS_24, training=True)
    # Fits in total, not in whole layers: the per-card shortfall is named.
    need = sum(row.total_bytes for row in plan_placement(config, [0, 1, 2]).cards)
    tight = {c: int(need / 3 * 1.001) for c in range(3)}
    with pytest.raises(UserError, match=r"whole layers .* card \d is short by"):
        plan_placement(config, [0, 1, 2], tight)


def test_split_balances_equal_layers() -> None:
    assert _split([1] * 9, 0, 0, [1.0, 1.0, 1.0]) == [0, 3, 6, 9]
    assert _split([1] * 9, 3, 0, [1.0, 1.0, 1.0]) == [0, 1, 5, 9]  # heavy embed → fewer layers on card 0
    assert _split([1] * 8, 0, 0, [1.0, 2.0, 1.0]) == [0, 2, 6, 8]  # double budget → double layers


def test_table_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    placement = plan_placement(get_preset("deepseek-coder-1.3b").config(), [0, 1, 2], CARDS_24, training=True)
    table = format_placement(placement)
    lines = table.splitlines()
    assert len(lines) == 5 and "24 layers over 3 cards" in lines[0]
    assert "embed, 0-" in lines[2] and lines[4].split()[2].endswith(",") and "norm, lm_head" in lines[4]
    assert main(["--model", "deepseek-coder-1.3b", "--gpus", "3", "--gpu-mem", "24", "--training"]) == 0
    assert "norm, lm_head" in capsys.readouterr().out
    assert main(["--model", "deepseek-v2-lite", "--gpus", "3", "--gpu-mem", "24", "--training"]) == 2
    assert "short by" in capsys.readouterr().err
    assert main(["--model", "tiny-deepseek-v3", "--max-memory", "1:20GiB"]) == 2
    assert "--max-memory" in capsys.readouterr().err


def test_to_device_moves_nested_tensors_and_leaves_caches() -> None:
    pair = namedtuple("pair", "a b")
    cache = DynamicCache()
    moved = _to_device((torch.ones(1), [pair(torch.ones(1), 3)], {"k": torch.ones(1), "c": cache}), torch.device("cpu"))
    assert isinstance(moved[1][0], pair) and moved[1][0].b == 3 and moved[2]["c"] is cache


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """Two identical tiny DeepSeek-V3 models (fp32, vocab 256) and a fixed batch."""
    torch.manual_seed(0)
    config = get_preset("tiny-deepseek-v3").config(vocab_size=256)
    whole = AutoModelForCausalLM.from_config(config)
    split = copy.deepcopy(whole)
    batch = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    return whole, split, batch


def test_split_model_same_loss_step_and_tokens(tiny_pair: tuple) -> None:
    whole, split, batch = tiny_pair
    placement = plan_placement(whole.config, ["cpu", "cpu", "cpu"], dtype=torch.float32, training=True)
    assert [len(row.layers) > 0 for row in placement.cards] == [True] * 3  # every card used: hooks on the path
    opt_split = torch.optim.AdamW(split.parameters(), lr=1e-3)  # before placing: parameters keep their identity
    apply_placement(split, placement)
    assert len(split._deepzero_placement_hooks) == len(placement.device_map)
    assert split.hf_device_map == placement.device_map
    opt_whole = torch.optim.AdamW(whole.parameters(), lr=1e-3)

    losses = []
    for model, opt in ((whole, opt_whole), (split, opt_split)):
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append((loss.detach(), model(input_ids=batch, labels=batch).loss.detach()))
    (before_w, after_w), (before_s, after_s) = losses
    torch.testing.assert_close(before_s, before_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(after_s, after_w, rtol=0, atol=1e-6)
    assert after_w < before_w

    prompt = batch[:1, :6]
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    whole.eval()
    split.eval()
    with torch.no_grad():
        assert torch.equal(split.generate(prompt, **kwargs), whole.generate(prompt, **kwargs))


def test_apply_placement_rejects_a_map_for_another_model(tiny_pair: tuple) -> None:
    whole, _, _ = tiny_pair
    other = plan_placement(get_preset("tiny-deepseek-v3").config(num_hidden_layers=2), ["cpu"] * 3, training=False)
    with pytest.raises(UserError, match="not in the device_map"):
        apply_placement(copy.deepcopy(whole), other)


def test_budget_errors() -> None:
    config = get_preset("tiny-deepseek-v3").config()
    with pytest.raises(UserError, match="no budget for card"):
        plan_placement(config, [0, 1, 2], {0: "24GiB"})
    with pytest.raises(UserError, match="cannot read size"):
        plan_placement(config, [0, 1], {0: "lots", 1: "1GiB"})
    assert plan_placement(config, [0], {0: 24 * GiB}).cards[0].layers == range(4)
