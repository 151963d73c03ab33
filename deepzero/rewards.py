"""GRPO's reward functions: ``--reward NAME[:weight]`` (repeatable), TRL's own built-ins or a user's file.

Built-ins (TRL 1.16's functions from ``trl.rewards``, called as ``GRPOTrainer`` calls them, completions as one
assistant message each):

- ``accuracy``: ``accuracy_reward`` (needs ``math-verify``): math-verify's equivalence of the completion's answer
  (LaTeX, ``\\boxed{}`` first) and the record's ``solution``, or its ``answer`` when it has no ``solution``;
  ``None`` (skipped) when the gold answer does not parse.
- ``think_format``: ``think_format_reward``: 1.0 when the completion is ``<think>...</think>`` then the answer.
- ``soft_overlong``: ``get_soft_overlong_punishment(max_completion_length, soft_punish_cache)`` (DAPO): 0 up to
  ``max_completion_length - soft_punish_cache`` tokens, then down to -1 at ``max_completion_length``.
- ``exact``: 1.0 when the completion's final answer equals the record's ``answer``'s final answer, else 0.0
  (:func:`final_answer`).

A user's own: ``--reward path/to/file.py:function`` with TRL's signature ``f(prompts, completions, completion_ids,
**columns) -> list[float | None]``: ``prompts`` the rendered prompt texts, ``completions`` the completion texts,
``completion_ids`` their token ids, and each record field as a keyword holding one value per completion (TRL
passes dataset columns so). Its metrics are named by the function, as TRL names a reward by its ``__name__``
(``rewards/function/mean``); its errors name ``path/to/file.py:function``. ``None`` means "does not apply": per TRL's rule the total is the sum of the weighted
rewards that are not ``None`` (``nansum``), and NaN where every reward is ``None``.

Specs are checked when parsed (unknown name, missing file or function, bad weight: one line each), so a run fails
in seconds, before any model loads. A reward that raises, returns the wrong number of values or a non-number
stops the run with one line naming it and the record.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepzero.errors import UserError

BUILTINS = ("accuracy", "think_format", "soft_overlong", "exact")
_FIX_SPEC = f"pass --reward NAME[:WEIGHT] with NAME one of {', '.join(BUILTINS)} or path/to/file.py:function"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_answer(text: str) -> str:
    """What ``exact`` compares: the text after the last ``####`` (GSM8K's answer marker) if there is one, else the
    last ``\\boxed{...}``, else the last number (thousands commas dropped), else the last non-empty line; stripped."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    if boxed := _BOXED.findall(text):
        return boxed[-1].strip()
    if numbers_ := _NUMBER.findall(text):
        return numbers_[-1].replace(",", "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact_reward(completions: list[str], answer: list[Any], **columns: Any) -> list[float]:
    """1.0 where :func:`final_answer` of the completion equals that of the record's ``answer`` (as numbers when both
    are numbers: ``72.0`` equals ``72``), else 0.0."""
    return [float(_same(final_answer(c), final_answer(str(a)))) for c, a in zip(completions, answer, strict=True)]


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


@dataclass(frozen=True)
class Reward:
    """One ``--reward``: its name, weight and function, and the spec that names it in errors."""

    name: str
    """The metric name (``rewards/{name}/mean``), TRL's ``reward_func.__name__`` rule: a built-in's name, or a
    user's function name."""
    weight: float
    fn: Callable[..., Any]
    messages: bool
    """TRL's built-ins read ``completion[0]["content"]``: they get each completion as one assistant message."""
    needs: tuple[str, ...] = ()
    """Record fields it reads (one of them suffices)."""
    source: str = ""
    """What errors name: ``path/to/file.py:function`` for a user's reward (the name where empty)."""

    @property
    def where(self) -> str:
        return self.source or self.name


class RewardSet:
    """The run's rewards: :meth:`score` gives the weighted total per completion and each reward's values."""

    def __init__(self, rewards: Sequence[Reward]) -> None:
        self.rewards = list(rewards)
        self.names: list[str] = [r.name for r in self.rewards]
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)

    def check_fields(self, fields: Sequence[str], where: str) -> None:
        """Refuse, before training, a reward whose record field the data lacks (``fields``: meta's
        ``record_fields``; ``where``: the data folder)."""
        for r in self.rewards:
            if r.needs and not set(r.needs) & set(fields):
                raise UserError(
                    f"--reward {r.where}",
                    f"reads the records' {' or '.join(repr(n) for n in r.needs)} field, {where} has"
                    f" {sorted(fields) or 'no fields'}",
                    f"prepare with --columns {r.needs[-1]}=YOUR_FIELD, or drop --reward {r.where}",
                )

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        records: list[dict[str, Any]],
        indices: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total [n], {name: [n]})``: each reward's values (NaN for ``None``) and TRL's total, the ``nansum`` of
        the weighted rewards, NaN where every reward is ``None``. ``indices`` (the records' dataset indices) only
        name a record in an error."""
        n = len(completions)
        if not len(prompts) == len(completion_ids) == len(records) == n:
            raise ValueError(
                f"score: {len(prompts)} prompts, {n} completions, {len(completion_ids)} ids, {len(records)} records"
            )
        keys = sorted({k for rec in records for k in rec})
        columns = {k: [rec.get(k) for rec in records] for k in keys}
        each = {}
        for r in self.rewards:
            each[r.name] = self._run(r, prompts, completions, completion_ids, columns, indices)
        per = torch.stack(list(each.values()), dim=1) if each else torch.zeros(n, 0)
        total = (per * self.weights.unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(per).all(dim=1)] = torch.nan
        return total, each

    def _run(
        self,
        r: Reward,
        prompts: list[str],
        completions: list[str],
        ids: list[list[int]],
        columns: dict[str, list[Any]],
        indices: Sequence[int] | None,
    ) -> torch.Tensor:
        def call(rows: list[int]) -> Any:
            texts = [completions[i] for i in rows]
            kwargs = {k: [v[i] for i in rows] for k, v in columns.items()}
            if r.name == "accuracy" and "solution" not in kwargs and "answer" in kwargs:
                kwargs["solution"] = [str(a) for a in kwargs["answer"]]
            done = [[{"role": "assistant", "content": t}] for t in texts] if r.messages else texts
            return r.fn(
                prompts=[prompts[i] for i in rows], completions=done, completion_ids=[ids[i] for i in rows], **kwargs
            )

        def record(i: int) -> str:
            start = prompts[i][:40] + ("..." if len(prompts[i]) > 40 else "")
            index = f"record {indices[i]}, " if indices is not None else ""
            return f"completion {i} of the batch ({index}prompt {start!r})"

        where, fix = f"--reward {r.where}", f"fix {r.where} so that it returns one float or None per completion"
        rows = list(range(len(completions)))
        for i in rows if r.needs else ():
            if all(columns.get(k, [None] * len(rows))[i] is None for k in r.needs):
                raise UserError(
                    where,
                    f"{record(i)} has no {' or '.join(repr(k) for k in r.needs)} field",
                    f"prepare the data with --columns {r.needs[-1]}=YOUR_FIELD, or drop --reward {r.where}",
                )
        try:
            out = call(rows)
        except Exception as err:  # a user's function may raise anything; it is named and re-raised
            first = next((i for i in rows if _raises(call, i)), None)
            at = record(first) if first is not None else f"a batch of {len(rows)} completions"
            raise UserError(
                where, f"raised {type(err).__name__}: {err} on {at}", f"fix {r.where} for this input"
            ) from err
        if not isinstance(out, Sequence) or isinstance(out, str) or len(out) != len(rows):
            got = f"{len(out)} values" if isinstance(out, Sequence) else f"a {type(out).__name__}"
            raise UserError(where, f"returned {got} for {len(rows)} completions (first: {record(0)})", fix)
        for i, value in enumerate(out):
            if value is not None and not isinstance(value, numbers.Real):
                raise UserError(where, f"returned {value!r} ({type(value).__name__}) for {record(i)}", fix)
        return torch.tensor([math.nan if v is None else float(v) for v in out], dtype=torch.float32)


def _raises(call: Callable[[list[int]], Any], i: int) -> bool:
    try:
        call([i])
    except Exception:  # only locating which completion made the batch call raise
        return True
    return False


def parse_rewards(
    specs: Sequence[str], max_completion_length: int | None = None, soft_punish_cache: int | None = None
) -> RewardSet:
    """The ``--reward`` specs as a :class:`RewardSet`; every problem is one line, raised here.

    ``soft_overlong`` needs ``max_completion_length`` (the data's, meta.json); ``soft_punish_cache`` defaults to a
    fifth of it (DAPO: 4,096 of 20,480)."""
    if not specs:
        raise UserError("--reward", "no reward given: GRPO needs at least one", _FIX_SPEC)
    rewards = []
    for spec in specs:
        reward = _parse_one(spec, max_completion_length, soft_punish_cache)
        if reward.where in (r.where for r in rewards):
            raise UserError(
                f"--reward {spec}", f"{reward.where} is given twice", "give each reward once, with its weight"
            )
        if same := next((r for r in rewards if r.name == reward.name), None):
            raise UserError(
                f"--reward {spec}",
                f"{same.where} is also named '{reward.name}' (a reward's metrics are named by its function,"
                f" rewards/{reward.name}/mean)",
                "rename one of the two functions",
            )
        rewards.append(reward)
    return RewardSet(rewards)


def _parse_one(spec: str, max_completion_length: int | None, cache: int | None) -> Reward:
    where = f"--reward {spec}"
    if ".py:" in spec:
        path, _, rest = spec.partition(".py:")
        function, _, weight = rest.partition(":")
        fn = _load(Path(f"{path}.py"), function, where)
        return Reward(function, _weight(weight, where), fn, messages=False, source=f"{path}.py:{function}")
    name, _, weight = spec.partition(":")
    w = _weight(weight, where)
    if name == "accuracy":
        from trl.import_utils import is_math_verify_available
        from trl.rewards import accuracy_reward

        if not is_math_verify_available():
            raise UserError(where, "needs the math-verify package, which is not installed", "pip install math-verify")
        return Reward(name, w, accuracy_reward, messages=True, needs=("solution", "answer"))
    if name == "think_format":
        from trl.rewards import think_format_reward

        return Reward(name, w, think_format_reward, messages=True)
    if name == "soft_overlong":
        from trl.rewards import get_soft_overlong_punishment

        if not (isinstance(max_completion_length, int) and max_completion_length > 0):
            raise UserError(where, "needs the maximum completion length", "prepare the data with --format prompts")
        cache = max_completion_length // 5 if cache is None else cache
        if not 0 < cache <= max_completion_length:
            raise UserError(
                where, f"soft punish cache {cache} must be in 1..{max_completion_length}", "pass a smaller one"
            )
        return Reward(name, w, get_soft_overlong_punishment(max_completion_length, cache), messages=True)
    if name == "exact":
        return Reward(name, w, exact_reward, messages=False, needs=("answer",))
    raise UserError(where, f"unknown reward '{name}'", _FIX_SPEC)


def _weight(text: str, where: str) -> float:
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UserError(where, f"weight '{text}' is not a finite number", "write NAME:WEIGHT, e.g. accuracy:0.5")
    return value


def _load(path: Path, function: str, where: str) -> Callable[..., Any]:
    """``function`` of the Python file ``path``, imported once; every failure is one line."""
    if not path.is_file():
        raise UserError(where, f"no such file {path}", "pass path/to/file.py:function with an existing file")
    if not function.isidentifier():
        raise UserError(where, f"'{function}' is not a function name", "pass path/to/file.py:function")
    module_name = f"deepzero_reward_{abs(hash(str(path.resolve())))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's module may raise anything on import
        sys.modules.pop(module_name, None)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(where, f"importing {path} raised {type(err).__name__}: {first}", f"fix {path}") from err
    fn = getattr(module, function, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        problem = f"{path} has no function '{function}'" + (f" (it has {', '.join(found)})" if found else "")
        raise UserError(where, problem, "name a function defined in the file")
    return fn
