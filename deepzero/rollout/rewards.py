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

- ``reasoning_accuracy``: ``reasoning_accuracy_reward`` (needs ``math-verify``): ``accuracy`` on the text after the
  reasoning's closing delimiter (``</think>``), 0 when the reasoning does not close.

A user's own: ``--reward path/to/file.py:function`` with TRL 1.16's signature ``f(prompts, completions,
completion_ids, **kwargs) -> list[float | None]``, called as ``GRPOTrainer`` calls it: ``prompts`` the records'
prompts as given (a string, or a message list for conversational data), ``completions`` the completion texts, or
for conversational prompts ``[{"role": "assistant", "content": text}]`` each, ``completion_ids`` their token ids,
each record field as a keyword holding one value per completion (TRL passes dataset columns so), and
``trainer_state`` (``.global_step``), ``log_extra(column, values)`` (a column in completions.jsonl) and
``log_metric(name, value)`` (a scalar in metrics.jsonl, averaged over the log window). A function without
``**kwargs`` gets only the keywords it names. Its metrics are named by the function, as TRL names a reward by its ``__name__``
(``rewards/function/mean``); its errors name ``path/to/file.py:function``. ``None`` means "does not apply": per TRL's rule the total is the sum of the weighted
rewards that are not ``None`` (``nansum``), and NaN where every reward is ``None``.

Specs are checked when parsed (unknown name, missing file or function, bad weight: one line each), so a run fails
in seconds, before any model loads. A reward that raises, returns the wrong number of values or a non-number
stops the run with one line naming it and the record.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import numbers
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from deepzero.errors import UserError
from deepzero.watchdog import phase

BUILTINS = (
    "accuracy",
    "reasoning_accuracy",
    "think_format",
    "soft_overlong",
    "exact",
    "code",
    "code_io",
    "code_io_all",
)
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


def exact_reward(
    completions: list[Any], answer: list[Any], log_extra: Callable[[str, list], None] | None = None, **columns: Any
) -> list[float]:
    """1.0 where :func:`final_answer` of the completion equals that of the record's ``answer`` (as numbers when both
    are numbers: ``72.0`` equals ``72``), else 0.0; logs the answers as ``answer_parsed`` (as TRL's accuracy rewards
    do: cons@k votes on it)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # a conversational prompt's
    answers = [final_answer(c) for c in texts]
    if log_extra is not None:
        log_extra("answer_parsed", answers)
    return [float(same_answer(a, final_answer(str(gold)))) for a, gold in zip(answers, answer, strict=True)]


def same_answer(a: str, b: str) -> bool:
    """Whether two final answers are equal: as text, or as numbers (``72.0`` equals ``72``)."""
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


DEFAULT_TIMEOUT_S = 600.0
"""``--reward-timeout``'s default: a reward call longer than this is a hung reward."""


class RewardSet:
    """The run's rewards: :meth:`score` gives the weighted total per completion and each reward's values; a call
    longer than ``timeout_s`` (0: none) stops the run with one line naming the reward."""

    def __init__(self, rewards: Sequence[Reward], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rewards = list(rewards)
        self.timeout_s = timeout_s
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
        raw_prompts: list[Any] | None = None,
        context: RewardContext | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total [n], {name: [n]})``: each reward's values (NaN for ``None``) and TRL's total, the ``nansum`` of
        the weighted rewards, NaN where every reward is ``None``. ``indices`` (the records' dataset indices) only
        name a record in an error. As TRL calls them: ``prompts`` the records' prompts as given (``raw_prompts``; the
        rendered texts without them), completions as assistant messages for conversational prompts, and with
        ``context`` its ``trainer_state``, ``log_extra`` and ``log_metric``."""
        n = len(completions)
        if not len(prompts) == len(completion_ids) == len(records) == n:
            raise ValueError(
                f"score: {len(prompts)} prompts, {n} completions, {len(completion_ids)} ids, {len(records)} records"
            )
        keys = sorted({k for rec in records for k in rec})
        columns = {k: [rec.get(k) for rec in records] for k in keys}
        each = {}
        raw = raw_prompts if raw_prompts is not None else prompts
        for r in self.rewards:
            each[r.name] = self._run(r, prompts, completions, completion_ids, columns, indices, raw, context)
        per = torch.stack(list(each.values()), dim=1) if each else torch.zeros(n, 0)
        total = (per * self.weights.unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(per).all(dim=1)] = torch.nan
        return total, each

    def score_rows(
        self,
        data: Any,
        indices: Sequence[int],
        completions: list[str],
        completion_ids: list[list[int]],
        context: RewardContext | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`score` of completions of a prompts split's rows (``data``: a ``PromptDataset``; ``indices``: each
        completion's prompt), with each prompt as rendered, as given, and its record's fields."""
        return self.score(
            [data.prompt_text(i) for i in indices], completions, completion_ids, [data.record(i) for i in indices],
            indices, [data.prompt(i) for i in indices], context,
        )  # fmt: skip

    def _run(
        self,
        r: Reward,
        prompts: list[str],
        completions: list[str],
        ids: list[list[int]],
        columns: dict[str, list[Any]],
        indices: Sequence[int] | None,
        raw: list[Any],
        context: RewardContext | None,
    ) -> torch.Tensor:
        def call(rows: list[int]) -> Any:
            texts = [completions[i] for i in rows]
            kwargs = {k: [v[i] for i in rows] for k, v in columns.items()}
            if r.needs == ("solution", "answer") and "solution" not in kwargs and "answer" in kwargs:
                kwargs["solution"] = [str(a) for a in kwargs["answer"]]
            given = [raw[i] for i in rows]
            chat = r.messages or any(isinstance(p, list) for p in given)  # TRL: conversational prompts
            done = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
            kwargs |= context.kwargs() if context is not None else {}
            return r.fn(
                prompts=given, completions=done, completion_ids=[ids[i] for i in rows], **_accepted(r.fn, kwargs)
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
            with _deadline(self.timeout_s, where), phase(f"in the reward {r.where}", every=True):
                out = call(rows)
        except UserError:
            raise
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


@contextlib.contextmanager
def _deadline(seconds: float, where: str) -> Iterator[None]:
    """A call that runs past ``seconds`` (on the main thread, where a timer signal can interrupt it) becomes one line
    naming ``where``; elsewhere, or with 0, no limit."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise UserError(
            where,
            f"did not return within {seconds:g} s (a hung reward stops every rank)",
            "make it faster, or pass a larger --reward-timeout (0: no limit)",
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class RewardContext:
    """What TRL 1.16 passes a reward besides its data: ``trainer_state`` (``global_step``: optimizer steps done),
    ``log_extra(column, values)`` (a column of the completions table: completions.jsonl here) and
    ``log_metric(name, value)`` (a scalar averaged over the log window: metrics.jsonl here)."""

    global_step: int = 0
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def answers(self, n: int) -> list[str | None]:
        """The answers the first reward logging ``answer_parsed`` extracted from the ``n`` completions (TRL's
        accuracy rewards and ``exact`` do; cons@k votes on them), or ``n`` Nones."""
        logged = self.extra.get("answer_parsed") or [None] * n
        return [None if a is None else str(a) for a in logged[:n]]

    def kwargs(self) -> dict[str, Any]:
        state = SimpleNamespace(global_step=self.global_step)
        return {"trainer_state": state, "log_extra": self.log_extra, "log_metric": self.log_metric}


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` as ``fn`` takes them: all of them with ``**kwargs`` (TRL's rewards), else those it names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: give it everything, as TRL does
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _raises(call: Callable[[list[int]], Any], i: int) -> bool:
    try:
        call([i])
    except Exception:  # only locating which completion made the batch call raise
        return True
    return False


def parse_rewards(
    specs: Sequence[str],
    max_completion_length: int | None = None,
    soft_punish_cache: int | None = None,
    sandbox: str = "bwrap",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RewardSet:
    """The ``--reward`` specs as a :class:`RewardSet`; every problem is one line, raised here.

    ``soft_overlong`` needs ``max_completion_length`` (the data's, meta.json); ``soft_punish_cache`` defaults to a
    fifth of it (DAPO: 4,096 of 20,480)."""
    if not specs:
        raise UserError("--reward", "no reward given: GRPO needs at least one", _FIX_SPEC)
    rewards = []
    for spec in specs:
        reward = _parse_one(spec, max_completion_length, soft_punish_cache, sandbox)
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
    return RewardSet(rewards, timeout_s)


def _parse_one(spec: str, max_completion_length: int | None, cache: int | None, sandbox: str = "bwrap") -> Reward:
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
    if name == "reasoning_accuracy":
        from trl.import_utils import is_math_verify_available
        from trl.rewards import reasoning_accuracy_reward

        if not is_math_verify_available():
            raise UserError(where, "needs the math-verify package, which is not installed", "pip install math-verify")
        return Reward(name, w, reasoning_accuracy_reward, messages=True, needs=("solution", "answer"))
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
    if name in ("code", "code_io", "code_io_all"):
        from deepzero.rollout.code_rewards import code_io_reward, code_reward

        box = shared_sandbox(sandbox)
        if name == "code":
            return Reward(name, w, code_reward(box), messages=False, needs=("test",))
        return Reward(
            name, w, code_io_reward(box, all_pass=name == "code_io_all"), messages=False, needs=("test_cases",)
        )
    raise UserError(where, f"unknown reward '{name}'", _FIX_SPEC)


_SANDBOXES: dict[str, Any] = {}


def shared_sandbox(mode: str) -> Any:
    """This process's sandbox of ``mode`` (``--sandbox``), made (and checked) once."""
    from deepzero.rollout.sandbox import Sandbox

    if mode not in _SANDBOXES:
        _SANDBOXES[mode] = Sandbox(mode)
    return _SANDBOXES[mode]


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
