"""DeepSpeed compiles its C++ ops (CPU Adam, the CPU all-reduce) on first use, under a lock file.

torch's builder waits, silently and for ever, while that lock exists; a build that was killed (Ctrl-C, a job
time limit, a lost session) leaves it behind, and every later launch then hangs before its first step. So every
deepzero process holds a shared ``flock`` on ``OWNERS`` in the build folder for its life (the kernel drops it when the
process dies, however it dies): a process that can take it exclusively knows no deepzero process is alive there,
so every op lock in the folder is a killed build's and is removed at once, with one line. A lock beside a live
deepzero process is some launch's build in progress (or another tool's): it is only called stale after
``STALE_AFTER_S``.

Each environment builds into its own folder (``TORCH_EXTENSIONS_DIR`` under ``sys.prefix``, set in
``deepzero/__init__.py`` unless the user set one), so two checkouts never rebuild each other's ops.

``python -m deepzero.op_builds [PRESET]`` (run by ``make setup`` for the seed preset) compiles the ops a preset loads
on the CPU accelerator once, up front: the first launch would otherwise stall a minute or more on 2 cores, every rank
waiting on the build without a word.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.cpp_extension import get_default_build_root

from deepzero.errors import UserError

# A build takes minutes (about 1 for CPU Adam on 2 cores); a lock this old has no live builder behind it.
STALE_AFTER_S = 30 * 60
OWNERS = "deepzero-processes.lock"
"""The file every deepzero process holds a shared flock on (the build folder's live users)."""
_held: dict[Path, Any] = {}


def build_root() -> Path:
    """Where torch builds extensions: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions (one folder per
    Python and accelerator under it)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def stale_locks(root: Path | None = None, now: float | None = None) -> list[Path]:
    """Lock files of op builds older than STALE_AFTER_S, oldest first."""
    return [lock for _, lock in stale_ages(root, now)]


def stale_ages(root: Path | None = None, now: float | None = None) -> list[tuple[float, Path]]:
    """``(modification time, lock)`` of the op build locks older than STALE_AFTER_S, oldest first; each read once."""
    root = root or build_root()
    now = time.time() if now is None else now
    aged = [(mtime, lock) for lock in op_locks(root) if (mtime := modified(lock)) is not None]
    return [(mtime, lock) for mtime, lock in sorted(aged) if now - mtime > STALE_AFTER_S]


def modified(lock: Path) -> float | None:
    """``lock``'s modification time; None once it is gone (torch takes and drops the lock on every op load, so a
    lock seen a moment ago may have been released since)."""
    try:
        return lock.stat().st_mtime
    except FileNotFoundError:
        return None


def op_locks(root: Path) -> list[Path]:
    """Every op build lock file in ``root`` (both layouts torch uses)."""
    return sorted(lock for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")] if lock.is_file())


def building(folder: Path) -> bool:
    """Whether a process is compiling in ``folder`` (its working folder, or named on its command line: ninja and the
    compiler torch's builder runs there)."""
    target = str(folder)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd == target or (target in args and any(t in args for t in ("ninja", "c++", "g++", "cc1plus", "nvcc"))):
            return True
    return False


def lock_report(root: Path | None = None) -> str:
    """What a wait on the op builds is behind, for the watchdog's line: each op lock, its age, and whether a build is
    running beside it (none: a killed build's lock, and the ``rm`` that clears it)."""
    root, now = root or build_root(), time.time()
    parts = []
    for lock in op_locks(root):
        if (mtime := modified(lock)) is None:
            continue
        state = "a build is running" if building(lock.parent) else f"no build is running: a killed build's; rm {lock}"
        parts.append(f"op build lock {lock} ({now - mtime:.0f} s old, {state})")
    return f"; waiting behind {', '.join(parts)}" if parts else ""


def claim_op_builds(root: Path | None = None) -> list[Path]:
    """At a process's start: when no other deepzero process is alive on ``root`` (an exclusive flock on ``OWNERS``
    succeeds), remove every op lock there (a killed build's) and return them; then hold a shared flock for this
    process's life. Once per process and folder."""
    import fcntl

    root = root or build_root()
    if root in _held:
        return []
    root.mkdir(parents=True, exist_ok=True)
    handle = (root / OWNERS).open("a")
    removed = []
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another deepzero process lives: its builds are its own
    else:
        for lock in op_locks(root):
            lock.unlink(missing_ok=True)
            removed.append(lock)
            print(f"deepzero: removed {lock}, left by a DeepSpeed op build that was killed; this launch builds the op")
    fcntl.flock(handle, fcntl.LOCK_SH)
    _held[root] = handle
    return removed


def check_op_builds(root: Path | None = None) -> None:
    """Clear the locks killed builds left (:func:`claim_op_builds`); refuse to start behind one too old to be a
    live build's: that launch would hang with no message."""
    claim_op_builds(root)
    if stale := stale_ages(root):
        mtime, lock = stale[0]
        started = time.strftime("%Y-%m-%d %H:%M", time.gmtime(mtime))
        raise UserError(
            str(lock),
            f"left by a DeepSpeed op build that started {started} UTC and never finished; every launch waits on it",
            f"rm {lock} (the next launch completes the build)",
        )


def preset_ops(cfg: dict[str, Any], accelerator: str | None = None) -> list[str]:
    """The DeepSpeed ops a preset loads. Its optimizer's, in the order DeepSpeed's engine picks it: none with
    torch_adam (torch's AdamW), cpu_adam when the optimizer is offloaded, else fused_adam. On the CPU accelerator
    every run also builds deepspeed_shm_comm (DeepSpeed's shared-memory collectives, comm/torch.py)."""
    comm = ["deepspeed_shm_comm"] if accelerator == "cpu" else []
    optimizer = cfg.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return comm
    if (optimizer.get("params") or {}).get("torch_adam") is True:
        return comm
    offload = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    return ["cpu_adam" if offload in ("cpu", "nvme") else "fused_adam", *comm]


BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}
"""DeepSpeed's builder class of each op :func:`preset_ops` names."""
SEED_PRESET = Path(__file__).resolve().parents[1] / "ds_configs" / "zero2.json"


def build_cpu_ops(preset: Path = SEED_PRESET) -> list[str]:
    """Compile (or find compiled) the ops ``preset`` loads on the CPU accelerator (:func:`preset_ops`); their
    names. Elsewhere nothing is done: a CUDA box builds its ops with nvcc on first use."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return []
    check_op_builds()
    from deepzero.dsconfig import load_json

    ops = preset_ops(load_json(preset), "cpu")
    for name in ops:
        accelerator.create_op_builder(BUILDERS[name]).load(verbose=False)
    return ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compile the DeepSpeed CPU ops a preset loads, once.")
    parser.add_argument("preset", nargs="?", type=Path, default=SEED_PRESET, help="a ds_configs/*.json preset")
    preset = parser.parse_args(argv).preset
    start = time.monotonic()
    print(
        f"deepzero: compiling the DeepSpeed CPU ops {preset.name} loads, once (minutes on 2 cores; launches reuse them)"
    )
    try:
        built = build_cpu_ops(preset)
    except UserError as err:
        sys.exit(f"error: {err}")
    ready = ", ".join(built) or "none needed"
    print(f"deepzero: DeepSpeed ops ready in {build_root()}: {ready} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
