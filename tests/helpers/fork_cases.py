"""Run many single-process ``python train.py ARGS`` commands with one import of torch, Transformers and DeepSpeed.

    python tests/helpers/fork_cases.py CASES.json PARALLEL

CASES.json is a list of ``{"args": [...], "env": {...}, "stdout": path, "stderr": path}``. This process imports
train.py's modules once, then forks one child per case (at most PARALLEL at a time); the child sets the case's
environment, points its stdout and stderr at the case's files and runs train.py as ``python train.py ARGS`` would
(``runpy``, ``__name__ == "__main__"``). The exit codes are written back as ``{"returncodes": [...]}`` to
CASES.json + ".out". A child is a fresh process for everything train.py does at run time; only what is read at
import (``HF_HUB_OFFLINE``, a faked CPU's sitecustomize) comes from this process's environment, so cases needing
a different one run as their own process instead (tests/test_errors.py). Each case then costs its own work, not
the ~7 CPU-seconds of imports.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import deepzero.trainer  # noqa: F401  the imports every child shares


def run_child(case: dict) -> None:
    """In the forked child: the case as ``python train.py ARGS``; never returns."""
    code = 1
    try:
        os.environ.update(case["env"])
        for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["train.py", *case["args"]]
        runpy.run_path("train.py", run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(spec: Path, parallel: int) -> None:
    cases = json.loads(spec.read_text())
    codes: list[int | None] = [None] * len(cases)
    running: dict[int, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    for index, case in enumerate(cases):
        while len(running) >= parallel:
            reap()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(case)
        running[pid] = index
    while running:
        reap()
    Path(f"{spec}.out").write_text(json.dumps({"returncodes": codes}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
