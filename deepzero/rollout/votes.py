"""What cons@k votes on: each sample's answer and which answers are the same (a ``Voter``), per the reward that
judges the samples.

- ``accuracy`` / ``reasoning_accuracy`` (TRL's): the answer math-verify parses as TRL's reward does; answers
  math-verify judges equal vote together (``\\frac{1}{2}``, ``0.5`` and ``1/2`` are one answer).
- ``exact``: its final answer (:func:`deepzero.rollout.rewards.final_answer`), equal as text or as numbers.
- ``code``, ``code_io``, ``code_io_all``: the program's text (the same program votes together).
- a benchmark: its own extraction and comparison (:mod:`deepzero.rollout.benchmarks`).
- a user's reward: the ``answer_parsed`` column it logs (as TRL's accuracy rewards do), equal as text.

A sample without an answer votes for "no answer" (``None``): lighteval's maj@n lets every sample vote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deepzero.rollout.rewards import final_answer, same_answer

NO_ANSWER = ("[unparseable]", "[skipped]", "")
"""``answer_parsed`` values that are no answer (TRL's accuracy rewards log the first two)."""


@dataclass(frozen=True)
class Voter:
    """``key(text, logged)``: a sample's answer (None: no answer) from its completion text and the answer its reward
    logged; ``same(a, b)``: whether two answers vote together."""

    name: str
    key: Callable[[str, str | None], Any]
    same: Callable[[Any, Any], bool]

    def groups(self, texts: Sequence[str], logged: Sequence[str | None]) -> list[int | None]:
        """Each sample's vote: the index of the first sample giving the same answer, None for no answer."""
        keys = [self.key(t, a) for t, a in zip(texts, logged, strict=True)]
        firsts: list[int] = []
        votes: list[int | None] = []
        for i, key in enumerate(keys):
            if key is None:
                votes.append(None)
                continue
            group = next((f for f in firsts if self.same(keys[f], key)), None)
            if group is None:
                firsts.append(i)
                group = i
            votes.append(group)
        return votes


def _logged(text: str, logged: str | None) -> str | None:
    return None if logged is None or logged in NO_ANSWER else logged


LOGGED = Voter("the answer_parsed the reward logged", _logged, lambda a, b: a == b)


EXACT = Voter("exact's final answer", lambda text, logged: final_answer(text) or None, same_answer)


def math_voter(name: str, extraction: Callable[[], list[Any]], mode: str, after_think: bool = False) -> Voter:
    """Answers parsed by math-verify with ``extraction()`` (its configs) in ``extraction_mode`` ``mode``, equal when
    math-verify verifies them; ``after_think``: only the text after ``</think>`` (no answer when it never closes)."""

    def key(text: str, logged: str | None) -> Any:
        from math_verify import parse

        if after_think:
            if "</think>" not in text:
                return None
            text = text.rsplit("</think>", 1)[1]
        parsed = parse(text, extraction_config=extraction(), extraction_mode=mode)
        return parsed or None

    def same(a: Any, b: Any) -> bool:
        from math_verify import verify

        return bool(verify(a, b))

    return Voter(name, key, same)


def _trl_extraction() -> list[Any]:
    """TRL 1.16's ``accuracy_reward`` extraction of a completion's answer."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False
    )
    return [config]


ACCURACY = math_voter("math-verify, as TRL's accuracy parses", _trl_extraction, "first_match")
REASONING_ACCURACY = math_voter(
    "math-verify after </think>, as TRL's reasoning_accuracy parses", _trl_extraction, "first_match", after_think=True
)
PROGRAM_TEXT = Voter("the program's text", lambda text, logged: text.strip() or None, lambda a, b: a == b)
"""Code rewards: samples writing the same program (up to surrounding whitespace) vote together."""
BUILTIN_VOTERS = {"accuracy": ACCURACY, "reasoning_accuracy": REASONING_ACCURACY, "exact": EXACT}
BUILTIN_VOTERS |= dict.fromkeys(("code", "code_io", "code_io_all"), PROGRAM_TEXT)


def voter_for(reward: str) -> Voter:
    """The voter of the reward named ``reward`` (a built-in's, else the answers the reward logs)."""
    return BUILTIN_VOTERS.get(reward, LOGGED)
