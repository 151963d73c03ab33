"""Each benchmark sample's verdict by lighteval 0.13 itself, so a score is comparable with published ones.

Two math stacks, kept apart on purpose: lighteval 0.13 pins ``latex2sympy2_extended==1.0.6``; math-verify 0.9 (which
TRL's ``accuracy_reward`` calls, and so GRPO's ``--reward accuracy``) pins ``1.11.0``. They cannot share one
environment, and they disagree on some answers (several boxes in one completion, decimals for surds and π, a gold
only one of them parses). So training rewards stay math-verify's in the project's venv (equal to TRL's), and
``--benchmark aime24 / aime25 / math500 / gpqa_diamond`` verdicts come from lighteval's own ``PassAtK`` metric in
lighteval's own venv (``make lighteval`` builds ``.venv-lighteval``), through one long-lived worker process
(:mod:`deepzero.rollout.lighteval_worker`). Without that venv, the verdicts fall back to the project's math-verify
port, said once per process and recorded in the summary (``verdicts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

ENV = Path(__file__).resolve().parents[2] / ".venv-lighteval"
WORKER = Path(__file__).with_name("lighteval_worker.py")
FALLBACK = "math-verify (the project's port; `make lighteval` for lighteval 0.13's own verdicts)"


def lighteval_python() -> Path | None:
    """The lighteval venv's Python (``DEEPZERO_LIGHTEVAL_PYTHON`` names another; ``none`` turns it off)."""
    named = os.environ.get("DEEPZERO_LIGHTEVAL_PYTHON")
    if named == "none":
        return None
    path = Path(named) if named else ENV / "bin" / "python"
    return path if path.is_file() else None


class Worker:
    """The worker process, started on first use; a job at a time (calls from threads wait their turn)."""

    def __init__(self, python: Path) -> None:
        self.python, self.proc, self.version = python, None, ""
        self.lock = threading.Lock()

    def scores(self, scoring: str, query: str, gold: str, texts: Sequence[str]) -> list[float]:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            job = {"scoring": scoring, "query": query, "gold": gold, "texts": list(texts)}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                self.proc = None
                raise RuntimeError(f"lighteval's worker ({self.python}) ended; run it alone to see why")
            return json.loads(line)["scores"]

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        self.proc = subprocess.Popen(
            [str(self.python), "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env | {"TOKENIZERS_PARALLELISM": "false"},
        )  # fmt: skip
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"lighteval's worker ({self.python}) did not start: run `make lighteval` again")
        self.version = json.loads(ready)["ready"]


_WORKER: list[Worker] = []
_WARNED: list[bool] = []


def worker() -> Worker | None:
    """This process's worker (None without lighteval's venv: said once)."""
    if not _WORKER:
        python = lighteval_python()
        if python is None:
            if not _WARNED:
                _WARNED.append(True)
                print(f"warning: benchmark verdicts by {FALLBACK}", file=sys.stderr, flush=True)
            return None
        _WORKER.append(Worker(python))
    return _WORKER[0]


def verdicts_by() -> str:
    """What decides the benchmark verdicts here, for the summary."""
    found = worker()
    if found is None:
        return FALLBACK
    return f"lighteval {found.version}" if found.version else "lighteval (its venv)"


def lighteval_scores(
    scoring: str, queries: Sequence[str], golds: Sequence[str], texts: Sequence[str]
) -> list[float] | None:
    """lighteval's verdict on each text (its query and gold beside it), a prompt's samples in one job; None
    without lighteval's venv."""
    found = worker()
    if found is None:
        return None
    out: list[float] = [0.0] * len(texts)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(queries, golds, strict=True)):
        groups.setdefault(key, []).append(i)
    for (query, gold), indices in groups.items():
        for i, score in zip(indices, found.scores(scoring, query, gold, [texts[i] for i in indices]), strict=True):
            out[i] = score
    return out
