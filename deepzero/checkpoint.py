"""Checkpoints through DeepSpeed's engine, published atomically, plus the final Hugging Face export.

Layout under ``<out>/checkpoints``: one folder per step (``step00000100``) written by
``engine.save_checkpoint`` under a ``.partial`` name, renamed when every rank has finished, and only then
pointed to by ``latest`` (replaced with ``os.replace``). A crash mid-save leaves the previous checkpoint as
``latest``. Old folders beyond ``keep_last`` are deleted only after a newer one is published.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero.errors import UserError

TAG_RE = re.compile(r"^step(\d{8})$")


@dataclass
class TrainState:
    """What the loop needs to continue exactly where it stopped (saved in DeepSpeed's client_state)."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0

    def advance(self, samples: int, tokens: int) -> None:
        """Count one optimizer step over ``samples`` rows holding ``tokens`` tokens."""
        self.step += 1
        self.samples_seen += samples
        self.tokens_seen += tokens

    def to_client_state(self) -> dict[str, Any]:
        return {"deepzero": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}}

    @classmethod
    def from_client_state(cls, client_state: dict[str, Any] | None) -> TrainState:
        return cls(**(client_state or {}).get("deepzero", {}))


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def published_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint folders, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name))


def latest_tag(ckpt_dir: Path) -> str | None:
    latest = ckpt_dir / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def save(engine: Any, ckpt_dir: Path, state: TrainState, keep_last: int) -> Path:
    """Save on all ranks, publish on rank 0, prune old checkpoints. Returns the published folder."""
    tag = tag_for(state.step)
    partial = f"{tag}.partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:  # left by a run that died mid-save: none of its files may be published with this one
        shutil.rmtree(ckpt_dir / partial, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=partial, client_state=state.to_client_state(), save_latest=False)
    torch.save(_rng_state(), ckpt_dir / partial / f"rng_rank{rank:03d}.pt")
    _barrier()
    final = ckpt_dir / tag
    if rank == 0:
        if final.exists():  # a step re-saved after resuming from an older checkpoint: keep the old one until swapped
            old = final.with_name(f"{tag}.superseded")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(ckpt_dir / partial, final)
            shutil.rmtree(old)
        else:
            os.replace(ckpt_dir / partial, final)
        _write_atomic(ckpt_dir / "latest", tag)
        _prune(ckpt_dir, keep_last, keep=tag)
    _barrier()
    return final


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    tags = published_tags(ckpt_dir)
    for old in tags[: max(0, len(tags) - keep_last)]:
        if old != keep:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    for stale in ckpt_dir.glob("*.partial"):  # left by a crash mid-save; never the one latest points to
        shutil.rmtree(stale, ignore_errors=True)


def load(engine: Any, ckpt_dir: Path, load_optimizer_states: bool = True) -> TrainState:
    """Load the checkpoint that ``latest`` points to; clear errors for missing or corrupt ones."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise UserError(str(ckpt_dir), "no checkpoint to resume from (no 'latest' file)", "drop --resume or fix --out")
    if not (ckpt_dir / tag).is_dir():
        raise UserError(str(ckpt_dir / "latest"), f"points to missing folder '{tag}'", "restore it or edit 'latest'")
    try:
        path, client_state = engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
        )
    except Exception as err:  # DeepSpeed raises many types for truncated or foreign files
        raise UserError(
            str(ckpt_dir / tag),
            f"checkpoint is unreadable ({type(err).__name__}: {str(err)[:160]})",
            _older_hint(ckpt_dir, tag),
        ) from None
    if path is None:
        raise UserError(str(ckpt_dir / tag), "DeepSpeed found no checkpoint files there", _older_hint(ckpt_dir, tag))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = ckpt_dir / tag / f"rng_rank{rank:03d}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return TrainState.from_client_state(client_state)


def _older_hint(ckpt_dir: Path, tag: str) -> str:
    older = [t for t in published_tags(ckpt_dir) if t < tag]
    if older:
        return f"write '{older[-1]}' into {ckpt_dir / 'latest'} to resume from the previous checkpoint"
    return "start without --resume"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
