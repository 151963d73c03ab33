"""DeepSpeed compiles its C++ ops (CPU Adam, the CPU all-reduce) on first use, under a lock file.

torch's builder waits, silently and for ever, while that lock exists; a build that was killed (Ctrl-C, a job
time limit, a lost session) leaves it behind, and every later launch then hangs before its first step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

from deepzero.errors import UserError

# A build takes minutes (about 1 for CPU Adam on 2 cores); a lock this old has no live builder behind it.
STALE_AFTER_S = 30 * 60


def build_root() -> Path:
    """Where torch builds extensions: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions (one folder per
    Python and accelerator under it)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def stale_locks(root: Path | None = None, now: float | None = None) -> list[Path]:
    """Lock files of op builds older than STALE_AFTER_S, oldest first."""
    root = root or build_root()
    now = time.time() if now is None else now
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    aged = [(lock.stat().st_mtime, lock) for lock in locks if lock.is_file()]
    return [lock for mtime, lock in sorted(aged) if now - mtime > STALE_AFTER_S]


def check_op_builds(root: Path | None = None) -> None:
    """Refuse to start behind a lock that a killed build left: that launch would hang with no message."""
    stale = stale_locks(root)
    if stale:
        lock = stale[0]
        started = time.strftime("%Y-%m-%d %H:%M", time.gmtime(lock.stat().st_mtime))
        raise UserError(
            str(lock),
            f"left by a DeepSpeed op build that started {started} UTC and never finished; every launch waits on it",
            f"rm {lock} (the next launch completes the build)",
        )
