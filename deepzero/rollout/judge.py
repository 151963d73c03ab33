"""A prompt's k samples judged: its rewards, the answers they give, how they vote, and whether each is correct, as
one line of samples.jsonl (shared by evaluate.py / sample.py and ``python -m deepzero.score``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepzero.rollout.rewards import RewardContext, RewardSet
from deepzero.rollout.scores import Condition, per_sample
from deepzero.rollout.votes import Voter, voter_for


@dataclass(frozen=True)
class Judge:
    """The rewards that score a sample, the condition that calls it correct, the voter that groups its answer."""

    rewards: RewardSet
    correct: Condition
    voter: Voter

    @classmethod
    def of(cls, rewards: RewardSet, correct: str | None, voter: Voter | None = None) -> Judge:
        """``correct``: ``--correct``'s text (default: the first reward ≥ 1); ``voter``: the reward's by default."""
        names = rewards.names
        condition = (
            Condition.parse(correct, names, "--correct") if correct else Condition.first_reward_at_least_one(names)
        )
        return cls(rewards, condition, voter or voter_for(names[0] if condition.name == "reward" else condition.name))

    def lines(
        self,
        data: Any,
        indices: Sequence[int],
        k: int,
        texts: Sequence[str],
        ids: Sequence[Sequence[int]],
        truncated: Sequence[bool],
    ) -> list[dict[str, Any]]:
        """The lines of prompts ``indices`` of ``data`` (a ``PromptDataset`` or ``RecordRows``), ``k`` samples each:
        ``texts`` their completions, ``ids`` their tokens, ``truncated`` whether each was cut off."""
        context = RewardContext()
        each = [i for i in indices for _ in range(k)]
        total, per_name = self.rewards.score_rows(data, each, list(texts), [list(x) for x in ids], context)
        answers = context.answers(len(texts))
        out = []
        for n, index in enumerate(indices):
            rows = range(n * k, (n + 1) * k)
            scores = {name: [_number(v[r]) for r in rows] for name, v in per_name.items()}
            rewards = [_number(total[r]) for r in rows]
            out.append(
                {
                    "index": index,
                    "prompt": data.prompt(index),
                    "completions": [texts[r] for r in rows],
                    "rewards": rewards,
                    "scores": scores,
                    "answers": [answers[r] for r in rows],
                    "votes": self.voter.groups([texts[r] for r in rows], [answers[r] for r in rows]),
                    "correct": [self.correct.verdict(sample) for sample in per_sample(rewards, scores)],
                    "lengths": [len(ids[r]) for r in rows],
                    "truncated": [bool(truncated[r]) for r in rows],
                }
            )
        return out


def _number(x: torch.Tensor) -> float | None:
    value = float(x)
    return None if math.isnan(value) else value
