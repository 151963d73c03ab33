"""LiveCodeBench (``--benchmark lcb``) as lighteval 0.13's ``lcb:codegeneration`` task runs it
(``lighteval/tasks/tasks/lcb/``, from LiveCodeBench's own ``lcb_runner``): its prompt, its code extraction (between
the last two fence lines), and its grading, ported into one program per sample that runs in the sandbox.

- **stdin problems** (no ``fn_name``): the code wrapped into a function (its imports kept, LCB's ``import_string``
  first, an ``if __name__ == '__main__':`` tail unwrapped), called once per test with the input on a patched stdin;
  stdout's stripped lines must equal the expected ones, line by line, or as ``Decimal`` numbers.
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


HARNESS = r"""
import ast, faulthandler, json, signal, sys
from decimal import Decimal
from io import StringIO
from types import ModuleType
from unittest.mock import mock_open, patch

IMPORTS = "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\nimport io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
CODE, TESTS, TIMEOUT, TOKEN = json.loads(__PAYLOAD__)


class Timeout(Exception):
    pass


def alarm(*_):
    raise Timeout()


signal.signal(signal.SIGALRM, alarm)


def clean_if_name(code):
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:
        pass
    return code


def make_function(code):
    try:
        imports, others = [], []
        for stmt in ast.parse(code).body:
            (imports if isinstance(stmt, (ast.Import, ast.ImportFrom)) else others).append(stmt)
        fn = ast.FunctionDef(name="wrapped_function", args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[],
                             kw_defaults=[], defaults=[]), body=others, decorator_list=[], lineno=-1)
        return IMPORTS + "\n" + ast.unparse(imports) + "\n" + ast.unparse(fn)
    except Exception:
        return code


def compile_code(code):
    signal.alarm(TIMEOUT)
    try:
        module = ModuleType("tmp_sol", "")
        exec(code, module.__dict__)
        return module.Solution() if "class Solution" in code else module
    finally:
        signal.alarm(0)


def call_method(method, inputs):
    lines = iter(inputs.split("\n"))

    @patch("builtins.open", mock_open(read_data=inputs))
    @patch("sys.stdin", StringIO(inputs))
    @patch("sys.stdin.readline", lambda *args: next(lines))
    @patch("sys.stdin.readlines", lambda *args: inputs.split("\n"))
    @patch("sys.stdin.read", lambda *args: inputs)
    def inner(_method):
        try:
            return _method()
        except SystemExit:
            pass

    return inner(method)


def stripped(text):
    return [line.strip() for line in text.strip().split("\n")]


def decimals(line):
    try:
        return True, [Decimal(x) for x in line.split()]
    except Exception:
        return False, []


def timed(run):  # run() under LCB's per-test alarm: its result and None, or None and why it failed
    try:
        signal.alarm(TIMEOUT)
        faulthandler.enable()
        return run(), None
    except Timeout:
        return None, "timeout"
    except Exception as err:
        return None, f"error: {type(err).__name__}"
    finally:
        signal.alarm(0)
        faulthandler.disable()


def printed(method, inputs):  # what method prints, fed inputs on stdin
    real, sys.stdout = sys.stdout, StringIO()
    try:
        call_method(method, inputs)
        return sys.stdout.getvalue()
    finally:
        sys.stdout = real


def same_lines(got, want):
    got, want = stripped(got), stripped(want)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a != b:
            (ok_a, a_), (ok_b, b_) = decimals(a), decimals(b)
            if not (ok_a and ok_b and a_ == b_):
                return False
    return True


def grade_stdio():
    method = getattr(compile_code(make_function(clean_if_name(CODE))), "wrapped_function", None)
    if method is None:
        return "no program"
    for inputs, want in zip(TESTS["inputs"], TESTS["outputs"]):
        got, failure = timed(lambda: printed(method, inputs))
        if failure:
            return failure
        if not same_lines(got, want):
            return "wrong output"
    return None


def grade_call():
    method = getattr(compile_code(IMPORTS + "\n\n" + CODE), TESTS["fn_name"], None)
    if method is None:
        return "no such function"
    for inputs, want in zip(TESTS["inputs"], TESTS["outputs"]):
        args = [json.loads(line) for line in inputs.split("\n")]
        got, failure = timed(lambda: method(*args))
        if failure:
            return failure
        if isinstance(got, tuple):
            got = list(got)
        if got != json.loads(want):
            return "wrong output"
    return None


try:
    failure = grade_call() if TESTS["fn_name"] else grade_stdio()
except Timeout:
    failure = "timeout"
except BaseException as err:
    failure = f"error: {type(err).__name__}"
sys.__stdout__.write(TOKEN + "\n" if failure is None else f"FAILED {failure}\n")
"""


def harness(code: str, tests_json: str, token: str) -> str:
    """The sandboxed program that grades ``code`` on ``tests_json`` as LCB does; it prints ``token`` when all pass."""
    payload = json.dumps([code, json.loads(tests_json), TIMEOUT_S, token])
    return HARNESS.replace("__PAYLOAD__", repr(payload))


def lcb_reward(sandbox: Any) -> Any:
    """The ``lcb`` benchmark's reward: 1.0 when the completion's code passes every test (TRL's signature)."""
    import secrets

    from deepzero.rollout.code_rewards import log_verdicts
    from deepzero.rollout.sandbox import Verdict

    def lcb(
        prompts: list[Any], completions: list[Any], lcb_tests: list[str], log_extra: Any = None, **kw: Any
    ) -> list[float]:
        token = f"deepzero-lcb-passed-{secrets.token_hex(8)}"
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        programs = [harness(extract_code(t), tests_, token) for t, tests_ in zip(texts, lcb_tests, strict=True)]
        verdicts = []
        for v in sandbox.run_many(programs):
            last = v.stdout.strip().splitlines()[-1] if v.stdout.strip() else ""
            if v.passed and last == token:
                verdicts.append(v)
            elif last.startswith("FAILED "):
                verdicts.append(Verdict("failed", last.removeprefix("FAILED "), ""))
            else:
                verdicts.append(v if not v.passed else Verdict("failed", "left before its tests finished", ""))
        log_verdicts(verdicts, log_extra, kw.get("log_metric"))
        return [float(v.passed) for v in verdicts]

    return lcb
