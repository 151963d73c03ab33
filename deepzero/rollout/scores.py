"""What k samples of a prompt say about the model, counted as lighteval 0.13 counts them: pass@k, cons@k, maj@n,
their standard errors, and the condition that judges a sample.

- **Every sample counts.** A sample its reward scored None, or without an answer, is wrong; a prompt whose gold
  does not parse (every sample None) scores 0 and stays in every denominator (the summary says how many).
- **pass@k** is the unbiased estimator of Chen et al. 2021, ``1 − C(n−c, k) / C(n, k)``, computed as lighteval's
  ``PassAtK`` does (a product, no large binomials); **avg@n** the share of correct samples, ``c / n`` (lighteval's
  ``AvgAtN``, R1's "pass@1 over k samples"): pass@1 and avg@n differ only in the last bit of a double.
- **cons@n** (R1's cons@64): every sample votes, one without an answer for "no answer"; answers the reward's
  :class:`~deepzero.rollout.votes.Voter` judges equal vote together (math-verify: ``\\frac{1}{2}``, ``0.5``, ``1/2``);
  the answer with most votes decides, a tie going to the answer seen first (lighteval's ``max(answers,
  key=answers.count)``); "no answer" winning, or a winning answer judged wrong, makes the prompt wrong.
- **maj@n** is lighteval's ``MajAtN`` as it stands: the completions' texts vote as they are, the most frequent text
  (ties: the first seen) judged.
- **Standard errors** are lighteval's ``mean_stderr``: the per-prompt values' sample standard deviation over √prompts.
- **A condition** (``--keep``, ``--correct``): ``NAME OP NUMBER`` with ``NAME`` ``reward`` (the weighted total)
  or a reward's name, ``OP`` one of ``>= > <= < == !=``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deepzero.errors import UserError
from deepzero.rollout.votes import LOGGED

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
    """The unbiased pass@k of ``n`` samples with ``c`` correct (``k`` ≤ ``n``), as the Codex paper and lighteval's
    ``PassAtK`` compute it (a numpy product, no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority(votes: Sequence[Hashable]) -> Hashable:
    """The vote given most often, a tie going to the one seen first (lighteval's ``max(votes, key=votes.count)``)."""
    counts: dict[Hashable, int] = {}
    for v in votes:
        counts[v] = counts.get(v, 0) + 1
    return max(votes, key=counts.__getitem__)


def consensus_correct(votes: Sequence[int | None], correct: Sequence[bool | None]) -> bool:
    """cons@n of one prompt: ``votes`` are each sample's answer group (the index of its group's first sample, None for
    no answer); the winning group's first sample decides, "no answer" winning is wrong."""
    top = majority(votes)
    return top is not None and correct[top] is True


def text_majority_correct(texts: Sequence[str], correct: Sequence[bool | None]) -> bool:
    """lighteval's maj@n of one prompt: the most frequent completion text (ties: the first seen) is judged."""
    top = majority(texts)
    return correct[texts.index(top)] is True


def mean_stderr(values: Sequence[float]) -> float | None:
    """lighteval's standard error of a mean: the sample standard deviation (n − 1) over √n; None under 2 values."""
    if len(values) < 2:
        return None
    mu = np.mean(values)
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (len(values) - 1)) / math.sqrt(len(values))


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


def summarise(lines: Iterable[dict], ks: Sequence[int] | None = None) -> dict[str, float | int | None]:
    """The summary over per-prompt lines (``correct``: one bool or None per sample; ``votes``: each sample's answer
    group, or ``answers`` whose equal texts vote together; ``completions`` for maj@n; ``lengths``; ``truncated``;
    ``rewards`` where the mean reward is wanted), as lighteval counts (the module docstring); ``ks``: pass@k's k's
    (default 1, 2, 4, ..., n). One pass, a line at a
    time: a job's lines are read from its file, never held together (only a few numbers per prompt are)."""
    wanted = sorted(set(ks)) if ks else None
    per_prompt: dict[str, list[float]] = {}
    prompts = unscored_prompts = unscored_samples = prompts_cut = 0
    samples: int | None = None
    reward_sum, rewards, length_sum, lengths, longest, cut = 0.0, 0, 0, 0, None, 0
    for line in lines:
        correct = line["correct"]
        n, c = len(correct), sum(ok is True for ok in correct)
        prompts += 1
        samples = n if samples is None else min(samples, n)
        unscored = sum(ok is None for ok in correct)
        unscored_samples += unscored
        unscored_prompts += unscored == n
        each = wanted or sorted({*(2**i for i in range(n.bit_length())), n})  # default: 1, 2, 4, ..., n
        figures = {f"pass@{k}": pass_at_k(n, c, k) for k in each if k <= n} | {"avg": c / n}
        votes = line.get("votes")
        if votes is None:  # lines without voter groups: the logged answers vote, equal texts together
            votes = LOGGED.groups([""] * n, line["answers"])
        figures["cons"] = float(consensus_correct(votes, correct))
        if "completions" in line:
            figures["maj"] = float(text_majority_correct(line["completions"], correct))
        for key, value in figures.items():
            per_prompt.setdefault(key, []).append(value)
        for r in line.get("rewards", ()):
            if r is not None and not math.isnan(r):
                reward_sum, rewards = reward_sum + r, rewards + 1
        length_sum, lengths = length_sum + sum(line["lengths"]), lengths + len(line["lengths"])
        if line["lengths"]:
            longest = max(line["lengths"]) if longest is None else max(longest, *line["lengths"])
        cut += sum(line["truncated"])
        prompts_cut += bool(line.get("prompt_cut"))
    out: dict[str, float | int | None] = {"prompts": prompts, "samples_per_prompt": samples or 0}
    for key, values in per_prompt.items():
        name = {"avg": f"avg@{samples}", "cons": f"cons@{samples}", "maj": f"maj@{samples}"}.get(key, key)
        out[name] = float(np.mean(values)) if len(values) == prompts else None
        out[f"{name}_stderr"] = mean_stderr(values) if len(values) == prompts else None
    out |= {"prompts_unscored": unscored_prompts, "samples_unscored": unscored_samples, "prompts_cut_left": prompts_cut}
    out["mean_reward"] = reward_sum / rewards if rewards else None
    out["mean_length"] = length_sum / lengths if lengths else None
    out["max_length"] = longest
    out["truncated_share"] = cut / lengths if lengths else None
    return out


def scored_nothing(summary: dict[str, object], benchmark: str | None, reward: Sequence[str]) -> UserError | None:
    """One line naming ``--benchmark`` or ``--reward`` when it scored no sample at all (every value None: figures of
    nothing)."""
    what = f"--benchmark {benchmark}" if benchmark else f"--reward {' '.join(reward)}"
    every = int(summary["prompts"]) * int(summary["samples_per_prompt"])  # type: ignore[call-overload]
    if not every or summary["samples_unscored"] != every:
        return None
    return UserError(
        what,
        f"scored none of the {every} samples (every value None): the figures say nothing",
        "check that the data's gold answers parse (math-verify) and that the reward reads the right field",
    )


def headline(summary: dict[str, object]) -> str:
    """The summary's figures in one line: each pass@k, avg@n, cons@n, maj@n with its standard error, then the
    rest; unscored samples named (counted as wrong)."""
    parts = [f"prompts {summary['prompts']}"]
    for key, value in summary.items():
        if key.startswith(("pass@", "avg@", "cons@", "maj@")) and not key.endswith("_stderr"):
            err = summary.get(f"{key}_stderr")
            parts.append(f"{key} {shown(value)}" + (f" ± {err:.2g}" if isinstance(err, float) else ""))
        elif key in ("mean_reward", "mean_length", "truncated_share", "written", "acceptance_rate", "cut_dropped"):
            parts.append(f"{key} {shown(value)}")
    if summary.get("samples_unscored"):
        parts.append(
            f"{summary['samples_unscored']} samples unscored ({summary['prompts_unscored']} prompts wholly),"
            " counted as wrong"
        )
    if summary.get("prompts_cut_left"):
        parts.append(f"{summary['prompts_cut_left']} prompts cut from the left to fit the context")
    return " | ".join(parts)


def shown(value: object) -> str:
    """A figure as printed: 4 significant digits for a float."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
