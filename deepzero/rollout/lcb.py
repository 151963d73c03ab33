"""LiveCodeBench (``--benchmark lcb``) as lighteval 0.13's ``lcb:codegeneration`` task runs it
(``lighteval/tasks/tasks/lcb/``, from LiveCodeBench's own ``lcb_runner``): its prompt, its code extraction (between
the last two fence lines), and its grading, split in two: the candidate's compilation and calls run in the sandbox
(:mod:`deepzero.rollout.candidate`), the grader (:data:`JUDGE`) in the referee outside it, which holds the expected
outputs and receives plain values only.

- **stdin problems** (no ``fn_name``): the code wrapped into a function (its imports kept, LCB's ``import_string``
  first, an ``if __name__ == '__main__':`` tail unwrapped), called once per test with the input on a patched stdin;
  what it printed comes back, and its stripped lines must equal the expected ones, line by line, or as ``Decimal``
  numbers.
- **call-based problems** (LeetCode, ``fn_name``): ``Solution().fn_name(*inputs)`` (or the module's function), each
  input line a JSON value; the result (a tuple read as a list) must equal the JSON output.

A sample passes when every test does, within 6 s each (LCB's timeout); the first failure ends it. The private test
cases come zlib-compressed and pickled in base64: they are unpickled with nothing but built-in types allowed (a
pickle naming any class is refused), never with ``pickle.loads``.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from typing import Any

from deepzero.errors import UserError

TIMEOUT_S = 6
"""LiveCodeBench's per-test timeout."""
MOST_TESTS_S = 300
"""The wall-clock limit of one sample's whole program (every test)."""


def prompt(record: dict[str, Any]) -> str:
    """lighteval's ``prepare_prompt``, byte for byte."""
    query = (
        "You will be given a question (problem specification) and will generate a correct Python program that"
        " matches the specification and passes all tests.\n\n"
    )
    query += f"Question: {record['question_content']}\n\n"
    if starter_code := record.get("starter_code"):
        query += (
            "You will use the following starter code to write the solution to the problem and enclose your code"
            " within delimiters.\n"
        )
        query += f"```python\n{starter_code}\n```\n\n"
    else:
        query += (
            "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the"
            " sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program"
            " runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
        )
        query += "```python\n# YOUR CODE HERE\n```\n\n"
    return query


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: test cases hold built-in types only")


def private_cases(encoded: str) -> list[dict[str, Any]]:
    """LCB's ``translate_private_test_cases`` (base64 → zlib → pickle → JSON) without running what a pickle names."""
    if not encoded:
        return []
    data = zlib.decompress(base64.b64decode(encoded))
    return json.loads(_BuiltinsOnly(io.BytesIO(data)).load())


def tests(record: dict[str, Any], where: str) -> str:
    """The record's tests as the harness reads them: ``{"inputs", "outputs", "fn_name"}`` as JSON text."""
    try:
        public = json.loads(record["public_test_cases"])
        private = private_cases(record.get("private_test_cases") or "")
        fn_name = json.loads(record.get("metadata") or "{}").get("func_name")
    except (ValueError, TypeError, KeyError, pickle.UnpicklingError, zlib.error) as err:
        raise UserError(
            f"--data {where}", f"a record's test cases do not decode ({type(err).__name__}: {err})", "fix the record"
        ) from None
    cases = public + private
    return json.dumps(
        {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases], "fn_name": fn_name}
    )


def extract_code(completion: str) -> str:
    """lighteval's LCB ``extract_code``: the lines between the last two lines holding a fence, else ""."""
    lines = completion.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


JUDGE = r"""
import json
from decimal import Decimal

TESTS, TIMEOUT = json.loads(__PAYLOAD__)


def stripped(text):
    return [line.strip() for line in text.strip().split("\n")]


def decimals(line):
    try:
        return True, [Decimal(x) for x in line.split()]
    except Exception:
        return False, []


def same_lines(got, want):
    if not isinstance(got, str):
        return False
    got, want = stripped(got), stripped(want)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a != b:
            (ok_a, a_), (ok_b, b_) = decimals(a), decimals(b)
            if not (ok_a and ok_b and a_ == b_):
                return False
    return True


for inputs, want in zip(TESTS["inputs"], TESTS["outputs"]):
    if TESTS["fn_name"]:
        got = __remote__.lcb_call(TESTS["fn_name"], [json.loads(line) for line in inputs.split("\n")], TIMEOUT)
        if isinstance(got, tuple):
            got = list(got)
        assert got == json.loads(want), "wrong output"
    else:
        assert same_lines(__remote__.stdio(inputs, TIMEOUT), want), "wrong output"
"""
"""LCB's grader (``grade_call`` / ``grade_stdio``), run by the referee against the loaded candidate."""


def trial(code: str, tests_json: str) -> Any:
    """The sandbox trial grading ``code`` on ``tests_json`` as LCB does."""
    from deepzero.rollout.sandbox import Trial

    tests_ = json.loads(tests_json)
    judge = JUDGE.replace("__PAYLOAD__", repr(json.dumps([tests_, TIMEOUT_S])))
    return Trial(code, "lcb_call" if tests_["fn_name"] else "lcb_stdio", judge, load_timeout=TIMEOUT_S)


def lcb_reward(sandbox: Any) -> Any:
    """The ``lcb`` benchmark's reward: 1.0 when the completion's code passes every test (TRL's signature)."""
    from deepzero.rollout.code_rewards import log_verdicts

    def lcb(
        prompts: list[Any], completions: list[Any], lcb_tests: list[str], log_extra: Any = None, **kw: Any
    ) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        trials = [trial(extract_code(t), tests_) for t, tests_ in zip(texts, lcb_tests, strict=True)]
        verdicts = sandbox.judge_many(trials)
        log_verdicts(verdicts, log_extra, kw.get("log_metric"))
        return [float(v.passed) for v in verdicts]

    return lcb
