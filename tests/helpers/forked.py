"""Scripts run as forks of one process that imported their heavy modules once.

Each rank or command of a test would otherwise import torch, Transformers and DeepSpeed (and torch._dynamo and
torch._inductor, which the engine's first optimizer pulls in) itself: about 10 CPU-seconds before its first line of
work, most of a tiny launch. A fork is a fresh process for everything the script does at run time (its environment,
arguments, process group, files, signals); only what is read at import time comes from the forking process, whose
environment the caller makes the same (tests/helpers/spawn_ranks.py, tests/helpers/fork_cases.py). Tests run with
OMP_NUM_THREADS=1, so no OpenMP thread pool exists yet to be lost in the fork.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path


def preimport() -> None:
    """What train.py imports, what ``deepspeed.initialize`` and the test models import: once, in the forking process.

    DeepSpeed's optimizer sanity check imports its Muon optimizer, which applies ``torch.compile`` at import and so
    imports torch._inductor: about 4 CPU-seconds per rank (a fifth of a short launch's, py-spy)."""
    sys.path.insert(0, os.getcwd())  # as for `python train.py` run from the repo
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import torch._dynamo  # noqa: F401
    import transformers.models.deepseek_v2.modeling_deepseek_v2
    import transformers.models.deepseek_v3.modeling_deepseek_v3
    import transformers.models.llama.modeling_llama
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import deepzero.trainer  # noqa: F401

    sys.path.pop(0)


def redirect_output(stdout: str, stderr: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at the named files; an empty name keeps it."""
    for fd, path in ((1, stdout), (2, stderr)):
        if path:
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)


def fork_script(script: str, args: list[str], env: dict[str, str], stdout: str = "", stderr: str = "") -> int:
    """Fork a child that runs ``python SCRIPT ARGS`` with ``env`` added to the environment (its stdout and stderr
    into the named files, else this process's); return its pid. The child never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(env)
        redirect_output(stdout, stderr)
        sys.argv = [script, *args]
        sys.path.insert(0, str(Path(script).resolve().parent))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
