"""Run many single-process ``python train.py ARGS`` commands with one import of torch, Transformers and DeepSpeed.

    python tests/helpers/fork_cases.py CASES.json PARALLEL

CASES.json is a list of ``{"args": [...], "env": {...}, "stdout": path, "stderr": path}``: each case is a fork of
this process (tests/helpers/forked.py), at most PARALLEL at a time, that runs train.py as ``python train.py ARGS``
would with the case's environment added. The exit codes are written as ``{"returncodes": [...]}`` to CASES.json +
".out". Cases that need a different environment at start-up (a faked CPU's sitecustomize) run as their own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from forked import fork_script, preimport


def main(spec: Path, parallel: int) -> None:
    cases = json.loads(spec.read_text())
    codes: list[int | None] = [None] * len(cases)
    running: dict[int, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    preimport()
    for index, case in enumerate(cases):
        while len(running) >= parallel:
            reap()
        running[fork_script("train.py", case["args"], case["env"], case["stdout"], case["stderr"])] = index
    while running:
        reap()
    Path(f"{spec}.out").write_text(json.dumps({"returncodes": codes}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
