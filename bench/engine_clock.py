"""Run a training loop with a clock on DeepSpeed's engine: when each rank is inside ``DeepSpeedEngine.forward``,
``backward`` and ``step``. bench/compare_loops.py splits every loop's step time with it into the engine's work (the
same in every loop) and the loop's own time (drawing data, counting targets, bookkeeping, logging, and the waits at
its own collectives), which is where one loop can cost more than another.

    deepspeed --num_gpus=3 --module bench.engine_clock train.py --deepspeed_config ... --out OUT ...
    deepspeed --num_gpus=3 --module bench.engine_clock bench.bare_loop --deepspeed_config ... --out OUT ...

The first argument besides the launcher's ``--local_rank`` is the loop: a script (``*.py``, from the repo root) or a
module; the rest are its own. When the loop ends (every loop here ends through ``deepzero.distributed.exit_process``)
each rank writes ``<--out>/engine_clock.rank<r>.json``: ``{"calls": [[start, end], ...]}`` in host time
(``time.time()``, the clock of the loops' records). A call costs the clock two ``time.time()`` reads.

For the ZeRO engines on the CPU: the pipeline engine steps through other methods, and on CUDA the engine's calls
return once their kernels are queued, so the device time would land at the loop's own sync points.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TIMED = ("forward", "backward", "step")


def clock_engine(calls: list[tuple[float, float]]) -> None:
    """Append ``(start, end)`` to ``calls`` for every call of the timed DeepSpeedEngine methods."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return method(self, *args, **kwargs)
            finally:
                calls.append((start, time.time()))

        return call

    for name in TIMED:
        setattr(DeepSpeedEngine, name, timed(getattr(DeepSpeedEngine, name)))


def write_on_exit(out: Path, calls: list[tuple[float, float]]) -> None:
    """Make ``deepzero.distributed.exit_process`` write this rank's calls to ``out`` first (before any loop imports it)."""
    from deepzero import distributed

    original = distributed.exit_process

    def exit_process(code: int) -> Any:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"engine_clock.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"calls": calls}))
        return original(code)

    distributed.exit_process = exit_process


def engine_seconds(out: Path, start: float, end: float, ranks: int) -> float | None:
    """Seconds between host times ``start`` and ``end`` that the ranks spent inside the engine's timed methods,
    averaged over the ``ranks`` ranks (None: no clock in ``out``)."""
    files = sorted(out.glob("engine_clock.rank*.json"))
    if not files:
        return None
    if len(files) != ranks:
        raise RuntimeError(f"{out}: {len(files)} engine clocks for {ranks} ranks (a rank did not end its loop)")
    inside = [sum(max(0.0, min(e, end) - max(s, start)) for s, e in json.loads(f.read_text())["calls"]) for f in files]
    return sum(inside) / len(inside)


def out_arg(loop_args: list[str]) -> str:
    """The loop's ``--out`` folder (``--out PATH`` or ``--out=PATH``)."""
    for i, arg in enumerate(loop_args):
        if arg == "--out" and i + 1 < len(loop_args):
            return loop_args[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    raise SystemExit("bench.engine_clock: the loop needs --out (where each rank writes its clock)")


def main(argv: list[str]) -> None:
    local_rank = [a for a in argv if a.startswith("--local_rank")]
    target, *loop_args = [a for a in argv if not a.startswith("--local_rank")]
    out = Path(out_arg(loop_args))
    calls: list[tuple[float, float]] = []
    clock_engine(calls)
    write_on_exit(out, calls)
    sys.argv = [target, *local_rank, *loop_args]
    if target.endswith(".py"):
        sys.path.insert(0, str(REPO))
        runpy.run_path(str(REPO / target), run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
