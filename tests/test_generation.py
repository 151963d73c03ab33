"""GRPO's sampler (deepzero.rollout.generation): a rank's rows in one batched ``generate`` call, each row drawn from its own
stream, so that a group's completions do not depend on the rows generated beside it (in process, tiny models)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepzero.presets import get_preset
from deepzero.rollout.generation import GroupSeeds, HFGenerate, cut_at_eos

VOCAB = 300
EOS = 2


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(get_preset("tiny-deepseek-v3").config(vocab_size=VOCAB)).eval()


def prompts(lengths: tuple[int, ...], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


def test_a_groups_completions_do_not_depend_on_the_rows_beside_it(model: torch.nn.Module) -> None:
    """Three prompts of different lengths, G 4: all 12 rows in one call, in chunks of 5 rows, and each group alone
    give the same completions; the rows of a group differ from each other, and a greedy call is Transformers'."""
    seeds, g = GroupSeeds(7), 4
    batch = prompts((5, 11, 8))
    rows = [p for p in batch for _ in range(g)]
    row_seeds = [s for i in range(len(batch)) for s in seeds.rows(0, i, g)]
    sampler = HFGenerate(12, (EOS,), 0)
    together = sampler.sample(model, rows, row_seeds)
    chunked = HFGenerate(12, (EOS,), 0, batch_rows=5).sample(model, rows, row_seeds)
    alone = [c for i, p in enumerate(batch) for c in sampler.sample(model, [p] * g, seeds.rows(0, i, g))]
    assert together == chunked == alone
    assert all(len({tuple(c) for c in together[i * g : (i + 1) * g]}) > 1 for i in range(len(batch)))
    assert together != sampler.sample(model, rows, [s + 1 for s in row_seeds])  # the seeds drive the draws
    greedy = model.generate(batch[0].view(1, -1), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=EOS)
    assert sampler.sample(model, batch[:1], None)[0] == cut_at_eos(greedy[0, 5:].tolist(), (EOS,))


def test_top_p_keeps_every_draw_in_the_nucleus(model: torch.nn.Module) -> None:
    """With top-p 0.05 at temperature 0.5 each sampled token is one the warped distribution allows: here the most
    likely one at every step (greedy), whatever the row's stream."""
    batch = prompts((6, 9))
    sampler = HFGenerate(8, (EOS,), 0, temperature=0.5, top_p=1e-6)
    sampled = sampler.sample(model, batch, [11, 12])
    assert sampled == sampler.sample(model, batch, None)


def test_continuous_batching_gives_each_row_a_completion() -> None:
    """``--generation-backend continuous`` (Transformers' ``generate_batch``): one completion per row in the rows'
    order, each at most the limit and cut at its end-of-sequence token; greedy equals the generate backend's greedy
    (the same model, no sampling), which pins the rows' order; the paged cache holds what the rows need (a page
    each here), not what Transformers would size from the free memory (14 GB of host RAM: CI's worker was killed
    for it). Run in its own process (tests/helpers/continuous_check.py), so that a regression fails this test
    instead of taking a pytest worker down."""
    import json
    import sys

    from conftest import REPO, cpu_env, run_bounded

    proc = run_bounded([sys.executable, "tests/helpers/continuous_check.py"], 300, cpu_env(PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sampled = out["sampled"]
    assert len(sampled) == 6 and all(0 < len(c) <= 6 and EOS not in c[:-1] for c in sampled)
    assert out["greedy"] == out["generate"] and len(out["greedy"]) == 3
    assert out["pages"] == 3  # three rows of at most 11 + 6 tokens: one 256-token page each


def test_top_k_one_is_greedy_and_every_end_token_stops_a_row(model: torch.nn.Module) -> None:
    """top-k 1 leaves one token, so sampling equals greedy whatever the row's stream; a row stops at the first of
    any of ``eos_ids`` (TRL takes the tokenizer's and the generation config's), wherever it comes."""
    batch = prompts((6, 9))
    greedy = HFGenerate(10, (EOS,), 0).sample(model, batch, None)
    assert HFGenerate(10, (EOS,), 0, top_k=1).sample(model, batch, [3, 4]) == greedy
    early = greedy[0][2]  # a token the first row produces third: as an extra end token it ends that row there
    ended = HFGenerate(10, (EOS, early), 0).sample(model, batch, None)
    assert ended[0] == greedy[0][: greedy[0].index(early) + 1]
    assert ended[1] == cut_at_eos(greedy[1], (EOS, early))


def test_the_end_tokens_are_the_tokenizers_and_the_generation_configs() -> None:
    from types import SimpleNamespace

    from deepzero.rollout.generation import eos_ids

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2, 9]))
    assert eos_ids(SimpleNamespace(eos_token_id=2), model) == (2, 7, 9)
    assert eos_ids(SimpleNamespace(eos_token_id=2), SimpleNamespace(generation_config=None)) == (2,)


@pytest.mark.parametrize(
    "text, message",
    [('{"temperature": 0.5}', "--generation-kwargs temperature: is set by"), ("[1]", "must be a JSON object"),
     ("{oops", "not JSON")],
)  # fmt: skip
def test_generation_kwargs_are_a_json_object_of_what_the_flags_do_not_own(text: str, message: str) -> None:
    from deepzero.args import generation_kwargs
    from deepzero.errors import UserError
    from deepzero.losses.grpo.settings import GRPOSettings

    with pytest.raises(UserError, match=message):
        GRPOSettings(rewards=("x",), generation_kwargs=generation_kwargs(text)).check()
    assert generation_kwargs('{"no_repeat_ngram_size": 3}') == {"no_repeat_ngram_size": 3}
