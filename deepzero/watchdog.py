"""Never a silent wait: ``with phase("loading the weights"):`` names what the process is doing; a watcher thread
prints one line when a phase runs past its limit (``[rank 2] still loading the weights after 60 s``), and again each
time the wait doubles, so a launch stuck on a rendezvous, an op build or a hung reward says where it is.

A start-up phase's limit is ``START_LIMIT_S``; a phase repeated in the loop (``every=True``) is judged against its
own usual time: the slowest of its earlier runs × ``LOOP_FACTOR`` (never under ``LOOP_FLOOR_S``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

START_LIMIT_S = 60.0
LOOP_FACTOR = 10.0
LOOP_FLOOR_S = 60.0
TICK_S = 0.1
"""How often the watcher looks."""
_state: dict[str, object] = {"name": None, "start": 0.0, "limit": 0.0, "said": 0.0, "detail": None}
_usual: dict[str, float] = {}
_lock = threading.Lock()
_thread: threading.Thread | None = None


def _rank() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def _watch() -> None:
    while True:
        time.sleep(TICK_S)
        with _lock:
            name, start, limit, said = _state["name"], _state["start"], _state["limit"], _state["said"]
            detail = _state["detail"]
            if name is None:
                continue
            waited = time.monotonic() - float(start)
            if waited >= float(limit) and waited >= 2 * float(said):
                _state["said"] = waited
                what = detail() if callable(detail) else ""
                sys.stderr.write(f"{_rank()}deepzero: still {name} after {waited:.0f} s{what}\n")
                sys.stderr.flush()


@contextmanager
def phase(
    name: str, limit_s: float | None = None, every: bool = False, detail: Callable[[], str] | None = None
) -> Iterator[None]:
    """Mark this process as ``name`` (e.g. "waiting for every rank to join") while the block runs; a line is
    printed when it outlasts ``limit_s`` (default: ``START_LIMIT_S``, or for an ``every`` phase its usual time ×
    ``LOOP_FACTOR``), ending in what ``detail()`` says the wait is on (e.g. an op build's lock)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_watch, name="deepzero-watchdog", daemon=True)
        _thread.start()
    if limit_s is None:
        limit_s = max(LOOP_FLOOR_S, LOOP_FACTOR * _usual[name]) if every and name in _usual else START_LIMIT_S
    with _lock:
        previous = dict(_state)
        _state.update(name=name, start=time.monotonic(), limit=limit_s, said=0.0, detail=detail)
    start = time.monotonic()
    try:
        yield
    finally:
        if every:
            _usual[name] = max(_usual.get(name, 0.0), time.monotonic() - start)
        with _lock:
            _state.update(previous)
