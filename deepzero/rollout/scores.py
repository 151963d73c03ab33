"""What k samples of a prompt say about the model: pass@k, cons@k, and the filter that keeps samples.

- **pass@k** is the unbiased estimator of Chen et al. 2021 (HumanEval): from ``n`` samples of which ``c`` are
  correct, the chance that at least one of ``k`` drawn without replacement is correct, ``1 − C(n−c, k) / C(n, k)``.
  pass@1 is then ``c / n``, DeepSeek-R1's "pass@1 over k samples" (the mean share of correct samples).
- **cons@k** (majority vote, R1's cons@64): the answer given most often among the samples (the answer a reward
  extracts, logged as ``answer_parsed`` as TRL's accuracy rewards do) decides; a tie goes to the answer seen first,
  as lighteval's ``maj@k`` (``Counter.most_common``). Samples without an answer do not vote.
- **A condition** (``--keep``, ``--correct``): ``NAME OP NUMBER`` with ``NAME`` ``reward`` (the weighted total)
  or a reward's name, ``OP`` one of ``>= > <= < == !=``.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from deepzero.errors import UserError

NO_ANSWER = ("[unparseable]", "[skipped]", "")
"""``answer_parsed`` values that are no answer (TRL's accuracy rewards log the first two)."""

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}
_CONDITION = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|!=|>|<)\s*(-?(?:\d+\.?\d*|\.\d+)(?:e-?\d+)?)\s*$")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``n`` samples with ``c`` correct (``k`` ≤ ``n``), as the Codex paper computes it
    (a product, no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer (ties: the first seen); None when no sample has one."""
    votes = Counter(a for a in answers if a is not None and a not in NO_ANSWER)
    return votes.most_common(1)[0][0] if votes else None


def consensus_correct(answers: Sequence[str | None], correct: Sequence[bool | None]) -> bool:
    """cons@k of one prompt: whether a sample giving the majority answer is correct."""
    top = majority(answers)
    return top is not None and any(a == top and ok for a, ok in zip(answers, correct, strict=True))


@dataclass(frozen=True)
class Condition:
    """``NAME OP NUMBER`` on a sample's rewards (``reward`` is the weighted total)."""

    name: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str, names: Sequence[str], flag: str) -> Condition:
        """``text`` checked against the run's reward ``names``; a bad one is one line naming ``flag``."""
        match = _CONDITION.match(text)
        if not match:
            raise UserError(f"{flag} {text}", "is not NAME OP NUMBER", f"write e.g. {flag} 'reward>=1'")
        name, op, value = match.group(1), match.group(2), float(match.group(3))
        if name != "reward" and name not in names:
            known = ", ".join(["reward", *names])
            raise UserError(f"{flag} {text}", f"'{name}' is no reward of this run", f"name one of {known}")
        return cls(name, op, value)

    @classmethod
    def first_reward_at_least_one(cls, names: Sequence[str]) -> Condition:
        """The default judge of correct: the first reward gives at least 1 (R1's binary accuracy)."""
        return cls(names[0], ">=", 1.0)

    def __call__(self, rewards: dict[str, float | None]) -> bool:
        """True when the sample's value passes; a reward that gave None passes nothing."""
        value = rewards.get(self.name)
        return value is not None and not math.isnan(value) and _OPS[self.op](value, self.value)

    def verdict(self, rewards: dict[str, float | None]) -> bool | None:
        """:meth:`__call__`, or None where the reward it reads gave None (the sample is not judged)."""
        value = rewards.get(self.name)
        return None if value is None or math.isnan(value) else self(rewards)

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}"


def per_sample(rewards: Sequence[float | None], scores: dict[str, Sequence[float | None]]) -> list[dict]:
    """Each sample's values a condition reads: ``reward`` (the weighted total) and each reward by its name."""
    return [{"reward": r} | {name: values[j] for name, values in scores.items()} for j, r in enumerate(rewards)]


def summarise(lines: Iterable[dict], ks: Sequence[int]) -> dict[str, float | int | None]:
    """The summary over per-prompt lines (``correct``: one bool or None per sample; ``answers``; ``lengths``;
    ``truncated``; ``rewards`` where the mean reward is wanted): prompts with no scored sample are counted, not
    averaged. One pass, a line at a time: a job's lines are read from its file, never held together."""
    ks = sorted(set(ks))
    prompts = scored = 0
    samples: int | None = None
    passes: dict[int, list[float]] = {k: [0.0, 0] for k in ks}
    cons, any_answer = 0, False
    reward_sum, rewards, length_sum, lengths, longest, cut = 0.0, 0, 0, 0, None, 0
    for line in lines:
        prompts += 1
        samples = len(line["correct"]) if samples is None else min(samples, len(line["correct"]))
        judged = [ok for ok in line["correct"] if ok is not None]
        if judged:
            scored += 1
            for k in ks:
                if k <= len(judged):
                    passes[k][0] += pass_at_k(len(judged), sum(judged), k)
                    passes[k][1] += 1
            cons += consensus_correct(line["answers"], line["correct"])
            any_answer = any_answer or any(a not in (None, *NO_ANSWER) for a in line["answers"])
        for r in line.get("rewards", ()):
            if r is not None and not math.isnan(r):
                reward_sum, rewards = reward_sum + r, rewards + 1
        length_sum, lengths = length_sum + sum(line["lengths"]), lengths + len(line["lengths"])
        if line["lengths"]:
            longest = max(line["lengths"]) if longest is None else max(longest, *line["lengths"])
        cut += sum(line["truncated"])
    out: dict[str, float | int | None] = {"prompts": prompts, "prompts_unscored": prompts - scored}
    for k, (total, count) in passes.items():
        out[f"pass@{k}"] = total / count if count else None
    out[f"cons@{samples or 0}"] = cons / scored if scored and any_answer else None
    out["mean_reward"] = reward_sum / rewards if rewards else None
    out["mean_length"] = length_sum / lengths if lengths else None
    out["max_length"] = longest
    out["truncated_share"] = cut / lengths if lengths else None
    out["samples_per_prompt"] = samples or 0
    return out
