"""DeepSpeed compiles its C++ ops (CPU Adam, the CPU all-reduce) on first use, under a lock file.

torch's builder waits, silently and for ever, while that lock exists; a build that was killed (Ctrl-C, a job
time limit, a lost session) leaves it behind, and every later launch then hangs before its first step.

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
