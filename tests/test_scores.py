"""pass@k, cons@k and the keep/correct conditions (deepzero.rollout.scores), against enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepzero.errors import UserError
from deepzero.rollout.scores import Condition, consensus_correct, majority, pass_at_k, summarise


def enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_1_is_r1s_mean_share_and_large_n_stays_finite() -> None:
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(64, 0, 64) == 0.0 and pass_at_k(64, 1, 64) == 1.0
    # Chen et al. 2021's example regime: 200 samples, a rare success; no 200-choose-k overflow
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_ties_go_to_the_first_answer_seen_and_no_answer_does_not_vote() -> None:
    assert majority(["3", "4", "4", "3"]) == "3"  # a tie: the first seen (lighteval's maj@k, Counter order)
    assert majority([None, "[unparseable]", "7", None, "[unparseable]"]) == "7"
    assert majority([None, "[skipped]"]) is None
    assert consensus_correct(["3", "4", "4"], [False, True, True])
    assert not consensus_correct(["3", "3", "4"], [False, False, True])
    assert not consensus_correct([None, None], [None, None])


def test_summary_counts_unscored_prompts_and_averages_the_rest() -> None:
    def line(correct: list, answers: list) -> dict:
        rewards = [None if ok is None else float(ok) for ok in correct]
        return {
            "correct": correct,
            "answers": answers,
            "rewards": rewards,
            "lengths": [4] * 4,
            "truncated": [False] * 4,
        }

    lines = [
        line([True, False, False, False], ["1", "2", "2", "3"]),  # majority "2" is wrong
        line([True, True, False, False], ["5", "5", "6", "7"]),  # majority "5" is right
        line([None] * 4, [None] * 4),  # the gold answer did not parse: unscored
    ]
    s = summarise(lines, [1, 2, 4])
    assert s["prompts"] == 3 and s["prompts_unscored"] == 1
    assert s["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert s["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)
    assert s["pass@4"] == 1.0 and s["cons@4"] == 0.5
    assert s["mean_reward"] == pytest.approx(3 / 8)


def test_conditions_read_the_total_or_a_reward_and_bad_ones_are_one_line() -> None:
    keep = Condition.parse("reward>=1", ["accuracy"], "--keep")
    assert keep({"reward": 1.0}) and not keep({"reward": 0.5}) and not keep({"reward": None})
    assert Condition.parse(" accuracy == 0 ", ["accuracy"], "--keep")({"accuracy": 0.0})
    with pytest.raises(UserError, match=r"--keep acc>=1: 'acc' is no reward of this run.*reward, accuracy"):
        Condition.parse("acc>=1", ["accuracy"], "--keep")
    with pytest.raises(UserError, match=r"--correct reward: is not NAME OP NUMBER"):
        Condition.parse("reward", ["accuracy"], "--correct")
