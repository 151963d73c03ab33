"""Where checkpoints go, checked at start: every rank sees the folder rank 0 publishes into, the disk holds
``--keep-last`` checkpoints and the export, and how fast it writes (a SIGTERM save must finish within the grace).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from deepzero.checkpoint import write_atomic
from deepzero.errors import UserError

ADAM_BYTES = 12
"""Per trainable parameter in a ZeRO checkpoint: fp32 master weight + Adam's two fp32 moments."""
SHARED_MARKER = ".shared-check-{token}"
"""The start-of-run marker in the checkpoint folder (a fresh name per run: no node has a cached lookup of it)."""
SHARED_WAIT_S = 3.0
"""How long a rank that does not see the marker keeps looking (a network filesystem's attribute cache)."""
NODE_LOCAL_KEY = "checkpoint.use_node_local_storage"


def check_shared_storage(ckpt_dir: Path, ds: dict[str, Any], config_path: str) -> None:
    """Refuse, on every rank with one line, a run whose ranks do not all see the same ``ckpt_dir``.

    Rank 0 writes a marker with a random token there, broadcasts the token (the broadcast orders the write before
    the reads), every rank reads the marker, one all-reduce names the ranks that do not see it, rank 0 removes it.
    DeepSpeed's node-local storage (each node's local rank 0 writes its own files) is refused outright: rank 0
    alone renames ``.partial``, writes ``latest`` and prunes, so the other nodes' files would never be published.
    """
    if (ds.get("checkpoint") or {}).get("use_node_local_storage"):
        raise UserError(
            f"{config_path}: {NODE_LOCAL_KEY}",
            "node-local checkpoint storage is not supported (rank 0 alone publishes a checkpoint, so the other nodes'"
            " files would never be part of it)",
            "remove it (or --ds checkpoint.use_node_local_storage=false) and put --out on a filesystem every node"
            " shares",
        )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from deepzero.distributed import broadcast_int, ranks_where

    rank, world = dist.get_rank(), dist.get_world_size()
    token = secrets.randbits(62) + 1 if rank == 0 else 0
    marker = ckpt_dir / SHARED_MARKER.format(token=token)
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, f"{token}\n")
        except OSError:
            token = -1  # check_writable passed moments ago; whatever it is, no rank can publish
    token = broadcast_int(token)
    marker = ckpt_dir / SHARED_MARKER.format(token=token)
    blind = ranks_where(token < 0 or not _sees(marker, str(token)))
    if rank == 0:
        marker.unlink(missing_ok=True)
    if blind:
        raise UserError(
            str(ckpt_dir),
            f"{'rank' if len(blind) == 1 else 'ranks'} {_ranks(blind)} of {world}"
            f" {'does' if len(blind) == 1 else 'do'} not see the file rank 0 wrote there, and only rank 0 publishes a"
            " checkpoint, so every rank must write into the same folder",
            "put --out on a filesystem that every node mounts at the same path (NFS, Lustre, ...)",
        )


def _sees(marker: Path, token: str) -> bool:
    """Whether ``marker`` holds ``token`` here, looking again for up to ``SHARED_WAIT_S``."""
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            if marker.read_text().strip() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def checkpoint_bytes(params: int, trainable: int, param_bytes: int) -> int:
    """Bytes of one ZeRO checkpoint: every parameter in the training dtype (``param_bytes``: 2 for bf16/fp16, 4 for
    fp32) plus Adam's two fp32 moments of each trainable one, and its fp32 master weight in 16-bit training (fp32
    training steps the weights themselves). ``plan.model_stats(config).total`` and the trainable count give the
    two numbers."""
    master = 4 if param_bytes < 4 else 0
    return params * param_bytes + trainable * (ADAM_BYTES - 4 + master)


def check_disk_space(out_dir: Path, checkpoint: int, keep_last: int, export: int) -> str | None:
    """Compare the free space under ``out_dir`` with ``keep_last`` checkpoints of ``checkpoint`` bytes, the one being
    written before the oldest is pruned, and the export. Raise when not even one checkpoint fits; return a warning
    line when fewer than that fit; None when all fit. Checkpoints already in the folder count as free (pruned)."""
    need = (keep_last + 1) * checkpoint + export
    folder = out_dir.absolute()
    while not folder.exists():
        folder = folder.parent
    ckpt_dir = out_dir / "checkpoints"
    existing = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file()) if ckpt_dir.is_dir() else 0
    free = shutil.disk_usage(folder).free + existing
    if free >= need:
        return None
    sizes = f"{_gb(free)} free under {folder}; each checkpoint takes {_gb(checkpoint)}, the export {_gb(export)}"
    if free < checkpoint + export:
        raise UserError(
            f"--out {out_dir}",
            f"not enough disk space for one checkpoint and the export ({sizes})",
            "free space there or pass another --out",
        )
    fits = max(1, (free - export) // checkpoint - 1)
    return (
        f"--out {out_dir}: room for {fits} checkpoint(s) + the export, not --keep-last {keep_last} + 1 being written"
        f" ({sizes}). Fix: free {_gb(need - free)} or pass --keep-last {fits}"
    )


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.2f} GB"


def measure_write_speed(folder: Path, size: int = 64 << 20, block: int = 4 << 20) -> float:
    """Bytes per second of writing ``size`` bytes to a new file in ``folder`` and fsyncing it (then removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".write_speed.{os.getpid()}.tmp"
    data = os.urandom(block)
    start = time.perf_counter()
    try:
        with path.open("wb") as f:
            for _ in range(max(1, size // block)):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return max(1, size // block) * block / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)
