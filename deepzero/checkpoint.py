"""Checkpoints through DeepSpeed's engine, published atomically, plus the final Hugging Face export.

Layout under ``<out>/checkpoints``: one folder per step (``step00000100``) written by
``engine.save_checkpoint`` under a ``.partial`` name, renamed when every rank has finished, and only then
pointed to by ``latest`` (replaced with ``os.replace``). A crash mid-save leaves the previous checkpoint as
``latest``. Old folders beyond ``keep_last`` are deleted only after a newer one is published.

Durable: every file of the new folder, the folder and ``checkpoints/`` are fsynced before ``latest`` changes, so a
power loss after the switch cannot leave ``latest`` naming files still in the page cache (cost: docs/reliability.md).
A save that fails to write (disk full, quota, I/O error) removes its ``.partial`` folder and ends every rank with
one line naming the last good checkpoint (:class:`SaveFailed`).

Only rank 0 publishes, so every rank must write into the same folder: ``checkpoint_storage.check_shared_storage``
verifies at start that every rank sees a file rank 0 wrote there (a multi-node run needs a shared filesystem).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero.errors import UserError

TAG_RE = re.compile(r"^step(\d{8})$")
WRITE_ERRORS = (
    "file write failed",
    "unexpected pos",
    "No space left",
    "Disk quota",
    "Input/output error",
    "iostream error",
)
"""torch.save reports a failed write as a RuntimeError from its zip writer (or its C++ stream: "basic_ios::clear:
iostream error"); these mark it as an I/O failure."""
NEARLY_FULL_BYTES = 16 << 20
"""Free space under which a write failure that names no cause is taken for a full disk."""


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


def write_atomic(path: Path, text: str | Iterable[str]) -> None:
    """``text`` (or its pieces, written as they come) published at ``path`` whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.writelines([text] if isinstance(text, str) else text)
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
    """Save on all ranks, fsync, publish on rank 0, prune old checkpoints. Returns the published folder.

    Raises :class:`SaveFailed` (a UserError) on every rank when any rank could not write its files.
    """
    tag = tag_for(state.step)
    partial = ckpt_dir / f"{tag}.partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:  # left by a run that died mid-save: none of its files may be published with this one
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    failure = _write(engine, ckpt_dir, partial, state, rank)
    _barrier()
    if failure is None:
        failure = _attempt(lambda: _fsync_files(partial, rank, world), ckpt_dir)
    code = int(_all_reduce_max(float(failure[0] if failure else 0)))  # every rank learns whether any failed
    if code:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        raise SaveFailed(ckpt_dir, tag, failure[1] if failure else os.strerror(code), code)
    failure = _attempt(lambda: _publish(ckpt_dir, partial, tag, keep_last), ckpt_dir) if rank == 0 else None
    code = int(_all_reduce_max(float(failure[0] if failure else 0)))  # also the barrier that ends the save
    if code:
        raise SaveFailed(ckpt_dir, tag, failure[1] if failure else os.strerror(code), code)
    return ckpt_dir / tag


def _publish(ckpt_dir: Path, partial: Path, tag: str, keep_last: int) -> None:
    """Rank 0: rename ``partial`` to ``tag``, make it durable, point ``latest`` at it, prune. On a failed write the
    new folder is removed again (unless ``latest`` already names it) and ``latest`` is unchanged."""
    final = ckpt_dir / tag
    try:
        if final.exists():  # a step re-saved after resuming from an older checkpoint: keep the old one until swapped
            old = final.with_name(f"{tag}.superseded")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        fsync_dir(ckpt_dir)  # the rename is durable before 'latest' names it
        write_atomic(ckpt_dir / "latest", tag)
        fsync_dir(ckpt_dir)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if latest_tag(ckpt_dir) != tag:
            shutil.rmtree(final, ignore_errors=True)
        ckpt_dir.joinpath(".latest.tmp").unlink(missing_ok=True)
        raise
    _prune(ckpt_dir, keep_last, keep=tag)


class SaveFailed(UserError):
    """A checkpoint could not be written; its ``.partial`` folder is gone and ``latest`` is unchanged."""

    def __init__(self, ckpt_dir: Path, tag: str, reason: str, code: int) -> None:
        self.code = code
        latest = latest_tag(ckpt_dir)
        last = f"the last good checkpoint is {ckpt_dir / latest}" if latest else "there is no earlier checkpoint"
        full = code in (errno.ENOSPC, errno.EDQUOT)
        super().__init__(
            f"{ckpt_dir / tag}",
            f"saving the checkpoint failed ({reason}); removed the partial folder, {last}",
            ("free space under " if full else "check the disk under ")
            + f"{ckpt_dir} (or lower --keep-last), then"
            + (" --resume" if latest else " start again"),
        )


def _write(engine: Any, ckpt_dir: Path, partial: Path, state: TrainState, rank: int) -> tuple[int, str] | None:
    """This rank's files of the checkpoint; (errno, reason) when a write failed.

    DeepSpeed's ``save_checkpoint`` ends with a barrier that a failed write skips: the failing rank joins it here,
    so that every rank then meets at the same all-reduce.
    """
    failure = _attempt(
        lambda: engine.save_checkpoint(
            str(ckpt_dir), tag=partial.name, client_state=_client_state(engine, state), save_latest=False
        ),
        ckpt_dir,
    )
    if failure is not None:
        _barrier()
        return failure
    return _attempt(lambda: torch.save(_rank_state(engine), partial / f"rng_rank{rank:03d}.pt"), ckpt_dir)


def _attempt(write: Any, folder: Path) -> tuple[int, str] | None:
    """Run ``write`` (into ``folder``); an OSError or torch's write RuntimeError becomes (errno, one-line reason)."""
    try:
        write()
    except OSError as err:
        return err.errno or errno.EIO, f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    except RuntimeError as err:
        text = " ".join(str(err).split())
        if not any(marker in text for marker in WRITE_ERRORS):
            raise
        full = "No space" in text or "unexpected pos" in text or shutil.disk_usage(folder).free < NEARLY_FULL_BYTES
        code = errno.ENOSPC if full else errno.EIO
        return code, f"{os.strerror(code)}: torch.save: {text[:120]}"
    return None


def _fsync_files(folder: Path, rank: int, world: int) -> None:
    """fsync every file under ``folder`` (rank r takes every world-th one), then the folders themselves."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files[rank::world]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if rank == 0:
        for sub in sorted({p.parent for p in files} | {folder}):
            fsync_dir(sub)


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (creations, renames) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    tags = published_tags(ckpt_dir)
    for old in tags[: max(0, len(tags) - keep_last)]:
        if old != keep:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    for stale in ckpt_dir.glob("*.partial"):  # left by a crash mid-save; never the one latest points to
        shutil.rmtree(stale, ignore_errors=True)


ZERO_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def check_resumable(ckpt_dir: Path, dp_size: int, four_bit: bool = False) -> str:
    """The tag ``latest`` names, after checks that need no engine: the folder exists, every ``.pt`` file in it is a
    complete torch zip archive, and a ZeRO checkpoint was written by ``dp_size`` data-parallel ranks (else it needs
    ``python -m deepzero.universal`` first; a run over a 4-bit base, whose checkpoint holds no base to convert,
    resumes on as many ranks as wrote it). Cheap: reads directory listings and zip footers only."""
    tag = latest_tag(ckpt_dir)
    if tag is None:
        raise UserError(str(ckpt_dir), "no checkpoint to resume from (no 'latest' file)", "drop --resume or fix --out")
    folder = ckpt_dir / tag
    if not tag or not folder.is_dir():
        raise UserError(str(ckpt_dir / "latest"), f"points to missing folder '{tag}'", "restore it or edit 'latest'")
    files = sorted(p for p in folder.rglob("*.pt") if p.is_file())
    if not files:
        raise UserError(str(folder), "holds no checkpoint files (*.pt)", _older_hint(ckpt_dir, tag))
    for path in files:
        if not (zipfile.is_zipfile(path) or _legacy_pickle(path)):
            raise UserError(
                str(path),
                f"is truncated or not a torch checkpoint ({path.stat().st_size} bytes)",
                _older_hint(ckpt_dir, tag),
            )
    saved = {int(m.group(1)) for p in files if (m := ZERO_FILE_RE.match(p.name))}
    if saved and not (folder / "zero").is_dir() and len(saved) != dp_size:
        run_dir = ckpt_dir.parent if ckpt_dir.name == "checkpoints" else ckpt_dir
        if four_bit:
            raise UserError(
                str(folder),
                f"was saved by {len(saved)} data-parallel ranks, this run has {dp_size}; a checkpoint over a 4-bit"
                " base holds the adapters only and resumes on the world that wrote it",
                f"launch {len(saved)} ranks with the same preset to --resume",
            )
        raise UserError(
            str(folder),
            f"was saved by {len(saved)} data-parallel ranks, this run has {dp_size}",
            f"convert it first: python -m deepzero.universal {run_dir}; then --resume (or run on {len(saved)} ranks)",
        )
    return tag


def _legacy_pickle(path: Path) -> bool:
    """A ``torch.save`` file without zip (``checkpoint.use_zipfile_serialization: false``): a pickle header."""
    with path.open("rb") as f:
        return f.read(1) == b"\x80"


def load(engine: Any, ckpt_dir: Path, load_optimizer_states: bool = True) -> TrainState:
    """Load the checkpoint that ``latest`` points to; clear errors for missing, corrupt or foreign ones."""
    tag = check_resumable(ckpt_dir, getattr(engine, "zero_ranks", engine.dp_size))  # sequence parallel: the world
    try:
        path, client_state = engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=True
        )
    except UserError:  # the engine's own check (a QLoRA checkpoint of another base)
        raise
    except Exception as err:  # DeepSpeed raises many types for truncated or foreign files
        raise UserError(
            str(ckpt_dir / tag),
            f"checkpoint is unreadable ({type(err).__name__}: {str(err)[:160]})",
            _older_hint(ckpt_dir, tag),
        ) from None
    if path is None:
        raise UserError(str(ckpt_dir / tag), "DeepSpeed found no checkpoint files there", _older_hint(ckpt_dir, tag))
    _restore_buffers(engine, ckpt_dir / tag)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = ckpt_dir / tag / f"rng_rank{rank:03d}.pt"
    objective = getattr(engine, "objective", None)
    if rng_file.is_file():
        saved = torch.load(rng_file, weights_only=True)
        _set_rng_state(saved)
        if hasattr(objective, "load_rank_state"):  # GRPO: this rank's generation batch, if steps were left on it
            objective.load_rank_state(saved.get("objective", {}))
    if hasattr(objective, "load_state_dict"):  # GRPO: the sampling RNG continues where it stopped
        objective.load_state_dict((client_state or {}).get("objective", {}))
    return TrainState.from_client_state(client_state)


def _client_state(engine: Any, state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds besides DeepSpeed's state: the loop's counters and the objective's own state."""
    objective = getattr(engine, "objective", None)
    extra = {"objective": objective.state_dict()} if hasattr(objective, "state_dict") else {}
    return state.to_client_state() | extra


def _restore_buffers(engine: Any, tag_dir: Path) -> None:
    """Buffers of a universal checkpoint (e.g. DeepSeek-V3's routing bias ``e_score_correction_bias``).

    DeepSpeed's universal load restores parameters and optimizer state but skips the module state dict, so the
    buffers would keep their initial values; ``ds_to_universal`` copies the model-states file that holds them.
    """
    files = sorted(tag_dir.glob("*model_states.pt"))  # mp_rank_00_… (ZeRO-1/2), zero_pp_rank_0_mp_rank_00_… (ZeRO-3)
    module = getattr(getattr(engine, "engine", None), "module", None)
    if not ((tag_dir / "zero").is_dir() and files and module is not None):
        return
    saved = torch.load(files[0], map_location="cpu", weights_only=True)
    own = dict(module.named_buffers())
    buffers = {
        n: saved["module"][n] for n in saved.get("buffer_names", []) if n in saved.get("module", {}) and n in own
    }
    with torch.no_grad():
        for name, value in buffers.items():
            own[name].copy_(value.to(own[name].device, own[name].dtype))


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


def _rank_state(engine: Any) -> dict[str, Any]:
    """This rank's own file of a checkpoint: its RNG states, and the objective's per-rank state (GRPO: a generation
    batch with steps left on it)."""
    objective = getattr(engine, "objective", None)
    extra = objective.rank_state() if hasattr(objective, "rank_state") else {}
    return _rng_state() | ({"objective": extra} if extra else {})


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_reduce_max(x: float) -> float:
    from deepzero.distributed import all_reduce_max

    return all_reduce_max(x)
