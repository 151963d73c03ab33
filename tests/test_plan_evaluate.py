"""The planner's ``--evaluate``: how evaluation and sampling (generation only) hold a model on the cards, in 16 bits
or NF4, and how many rows one generate call takes; the KV cache it counts is the one ``generate`` really keeps."""

from __future__ import annotations

import pytest
import torch
from test_plan import cache_test_config
from transformers import AutoModelForCausalLM

from deepzero import plan
from deepzero.errors import UserError
from deepzero.placement import plan_placement
from deepzero.plan import GiB, Setup, card_bytes, kv_layer_bytes, model_stats, plan_evaluation, plan_evaluation_of
from deepzero.presets import PRESETS

N, GPU = 3, 24 * GiB
PROMPT, COMPLETION, MOST = 512, 3584, 512
TOKENS = PROMPT + COMPLETION


def stats_of(name: str) -> plan.ModelStats:
    return model_stats(PRESETS[name].config(), name)


def fullest(cards: tuple[plan.CardBytes, ...]) -> int:
    return max(c.total for c in cards)


def test_a_small_model_runs_a_whole_bf16_copy_on_every_card_with_many_rows() -> None:
    """R1-Distill-Qwen-1.5B on 3 × 24 GiB: every card a copy, as many rows as fit (one more does not)."""
    stats = stats_of("deepseek-r1-distill-qwen-1.5b")
    p = plan_evaluation("deepseek-r1-distill-qwen-1.5b", N, 24, PROMPT, COMPLETION, MOST)
    assert (p.mode, p.weights_dtype, p.copies) == ("data-parallel", "bf16", N)
    assert 64 < p.rows_per_call < MOST
    (card,) = card_bytes(stats, 1, p.rows_per_call, PROMPT, COMPLETION)
    assert card.weights == 2 * stats.total and card.layers == range(28)
    assert card.kv_cache == p.rows_per_call * TOKENS * 28 * (2 * 2 * 128) * 2  # 2 KV heads × 128, k and v, bf16
    assert p.per_card_bytes == card.total <= GPU
    assert fullest(card_bytes(stats, 1, p.rows_per_call + 1, PROMPT, COMPLETION)) > GPU
    assert "fit one 24 GiB card" in p.reason and p.describe().startswith("data-parallel: 3 copies, bf16 weights")
    few = plan_evaluation_of(stats, N, 24, PROMPT, COMPLETION, 16)
    assert few.rows_per_call == 16 and "(the most asked)" in few.reason


def test_32b_splits_its_bf16_layers_over_the_cards() -> None:
    """R1-Distill-Qwen-32B's bf16 weights (61 GiB) fit no card but split over three they leave room for a few rows;
    the split is the one ``placement.plan_placement`` makes for the same bytes."""
    stats = stats_of("deepseek-r1-distill-qwen-32b")
    p = plan_evaluation_of(stats, N, 24, PROMPT, COMPLETION, MOST)
    assert (p.mode, p.weights_dtype, p.copies) == ("placement", "bf16", 1)
    assert 2 * stats.total > 60 * GiB and fullest(card_bytes(stats, 1, 1, PROMPT, COMPLETION)) > GPU
    cards = card_bytes(stats, N, p.rows_per_call, PROMPT, COMPLETION)
    assert sum(c.weights for c in cards) == 2 * stats.total  # every parameter once, in bf16
    assert [c.layers.start for c in cards][1:] == [c.layers.stop for c in cards][:-1] and cards[-1].layers.stop == 64
    assert all(GPU - 4 * GiB < c.total <= GPU for c in cards) and p.per_card_bytes == fullest(cards)
    layer_kv = kv_layer_bytes(stats, p.rows_per_call, TOKENS, 2)
    assert layer_kv == p.rows_per_call * TOKENS * (2 * 8 * 128) * 2  # 8 KV heads × 128, k and v, bf16
    assert all(c.kv_cache == len(c.layers) * layer_kv for c in cards)
    assert [bool(c.logits) for c in cards] == [False, False, True]
    assert p.rows_per_call >= 1 and fullest(card_bytes(stats, N, p.rows_per_call + 1, PROMPT, COMPLETION)) > GPU
    assert "61.0 GiB do not fit one 24 GiB card; split over 3 cards" in p.reason
    # placement.py, given the plan's KV cache per layer and its logits (one position of the rows), balances the same
    held = plan_placement(
        PRESETS["deepseek-r1-distill-qwen-32b"].config(),
        ["cpu"] * N,
        dict.fromkeys(range(N), GPU),
        reserve_per_layer_bytes=layer_kv,
        seq_len=1,
        micro_batch=p.rows_per_call,
    ).cards
    assert max(r.total_bytes for r in held) == max(c.weights + c.kv_cache + c.logits for c in cards)


def test_70b_splits_its_nf4_base_over_the_cards() -> None:
    """R1-Distill-Llama-70B: bf16 fits neither one card nor three; its NF4 base (the bytes the QLoRA planner counts)
    fits no single card; split over three it leaves room for rows."""
    stats = stats_of("deepseek-r1-distill-llama-70b")
    p = plan_evaluation_of(stats, N, 24, PROMPT, COMPLETION, MOST)
    assert (p.mode, p.weights_dtype, p.copies) == ("placement-4bit", "nf4", 1)
    assert fullest(card_bytes(stats, N, 1, PROMPT, COMPLETION)) > GPU
    nf4 = plan.unit_bytes(stats, "bf16", four_bit=True)
    qlora = Setup(stage=2, world_size=N, lora_rank=16, four_bit=True)
    assert sum(nf4) == plan.four_bit_base_bytes(stats, qlora, adapters=False) > GPU
    assert fullest(card_bytes(stats, 1, 1, PROMPT, COMPLETION, four_bit=True)) > GPU
    cards = card_bytes(stats, N, p.rows_per_call, PROMPT, COMPLETION, four_bit=True)
    assert sum(c.weights for c in cards) == sum(nf4) and p.per_card_bytes == fullest(cards) <= GPU
    assert p.rows_per_call >= 4
    assert fullest(card_bytes(stats, N, p.rows_per_call + 1, PROMPT, COMPLETION, four_bit=True)) > GPU
    assert p.reason.count("do not fit one 24 GiB card") == 2


def test_nf4_on_one_card_and_nothing_fits() -> None:
    """One card: no split to try, so 14B goes 4-bit on it; a card too small for one row says so."""
    p = plan_evaluation("deepseek-r1-distill-qwen-14b", 1, 24, PROMPT, COMPLETION, MOST)
    assert (p.mode, p.weights_dtype, p.copies) == ("data-parallel-4bit", "nf4", 1) and p.rows_per_call >= 1
    none = plan_evaluation("deepseek-r1-distill-qwen-1.5b", N, 1.2, PROMPT, COMPLETION, MOST)
    assert (none.mode, none.rows_per_call, none.copies) == ("does-not-fit", 0, 0) and none.per_card_bytes > 1.2 * GiB
    assert "nothing fits one row of 512 + 3,584 tokens" in none.reason and none.describe().startswith("does not fit")
    with pytest.raises(UserError, match="unknown dtype"):
        plan_evaluation("deepseek-r1-distill-qwen-1.5b", N, 24, PROMPT, COMPLETION, MOST, dtype="int8")


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "qwen2-gqa"])
def test_the_kv_cache_is_the_one_generate_keeps(name: str) -> None:
    """Transformers' ``generate`` on 3 rows of 5 + 7 tokens (bf16): each layer's DynamicCache holds the rows at
    prompt + completion - 1 tokens (the last token is never fed back); the plan counts prompt + completion, each
    card its layers (MLA: the latent and the rotary key; GQA: every KV head's key and value)."""
    config = cache_test_config(name)
    stats = model_stats(config, name)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    prompt, completion, rows = 5, 7, 3
    ids = torch.randint(0, 100, (rows, prompt))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=completion,
        min_new_tokens=completion,
        do_sample=True,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (rows, prompt + completion)
    cache = out.past_key_values
    held = [sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)) for layer in cache.layers]
    assert len(held) == stats.arch.layers and len(set(held)) == 1
    per_token = held[0] // (rows * (prompt + completion - 1))
    assert per_token * rows * (prompt + completion - 1) == held[0]
    cards = card_bytes(stats, 2, rows, prompt, completion)
    assert [c.kv_cache for c in cards] == [len(c.layers) * per_token * rows * (prompt + completion) for c in cards]
    (whole,) = card_bytes(stats, 1, rows, prompt, completion)
    assert whole.kv_cache == sum(held) * (prompt + completion) // (prompt + completion - 1)


def test_cli_prints_the_mode_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "deepseek-r1-distill-qwen-32b", "--evaluate", "--completion-len", "3584", "--samples", "8"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "mode              placement\n" in out and "weights           bf16\n" in out
    assert "copies            1 (over 3 cards)" in out and "rows per call" in out and "prompts per call" in out
    assert "why               bf16 weights 61.0 GiB do not fit one 24 GiB card; split over 3 cards" in out
    assert "KV cache" in out and "GPU GiB" in out
    assert plan.main([*argv[:3], "--grpo"]) == 2
    assert plan.main([*argv[:3], "--samples", "0"]) == 2
    assert "error: --evaluate with --grpo" in capsys.readouterr().err
