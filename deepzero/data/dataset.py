"""Reading prepared data: packed token rows on disk, a resumable global-batch sampler, and the loaders.

On-disk format (written by :mod:`deepzero.data.prepare`): ``<dir>/meta.json``; ``<dir>/{train,val}.bin``, a raw
C-order array of shape ``[n_rows, seq_len + 1]`` and dtype ``meta["dtype"]``; for chat data also
``<dir>/{train,val}.mask.bin``, uint8 of the same shape, 1 where the token is a training target (assistant text).

Each row yields ``input_ids = row[:-1]`` and targets ``row[1:]``, already shifted. Transformers' causal-LM loss
shifts ``labels`` itself unless it is given ``shift_labels``, and it only computes a loss when ``labels`` is not None,
so a sample carries both keys holding the same shifted targets: ``model(**batch).loss`` is then the mean
cross-entropy of ``logits[:, t]`` against ``row[t + 1]`` over every position (tested for DeepseekV3ForCausalLM).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from deepzero.errors import UserError

META_FILE = "meta.json"
SPLITS = ("train", "val")
IGNORE_INDEX = -100
_PREPARE = "run python data/prepare.py --input stdlib --tokenizer train --out {dir}"


def split_files(data_dir: Path | str, split: str) -> tuple[Path, Path]:
    """The token file and the loss-mask file (chat only) of one split."""
    d = Path(data_dir)
    return d / f"{split}.bin", d / f"{split}.mask.bin"


def load_meta(data_dir: Path | str) -> dict[str, Any]:
    """Read ``meta.json`` and check that every split file is there with the size it promises."""
    d = Path(data_dir)
    fix = _PREPARE.format(dir=d)
    if not d.is_dir():
        raise UserError(str(d), "no such data folder", fix)
    meta_path = d / META_FILE
    if not meta_path.is_file():
        raise UserError(str(meta_path), "missing, so the data folder was never prepared (or not finished)", fix)
    meta = _read_meta(meta_path, fix)
    row_bytes = (meta["seq_len"] + 1) * np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        n_rows = meta["n_rows"][split]
        tokens, mask = split_files(d, split)
        expected = [(tokens, n_rows * row_bytes)]
        if _has_mask(meta):
            expected.append((mask, n_rows * (meta["seq_len"] + 1)))
        for path, size in expected:
            if not path.is_file() or path.stat().st_size != size or size == 0:
                found = path.stat().st_size if path.is_file() else "missing"
                raise UserError(str(path), f"expected {size} bytes ({n_rows} rows), found {found}", fix)
    return meta


def _read_meta(meta_path: Path, fix: str) -> dict[str, Any]:
    """meta.json as a dict with the keys training reads, or one line naming what is wrong with it."""
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(str(meta_path), f"not valid JSON ({err})", fix) from None
    problems = []
    if not isinstance(meta, dict):
        meta, problems = {}, ["top level is not a JSON object"]
    if not (isinstance(meta.get("seq_len"), int) and meta["seq_len"] > 0):
        problems.append(f"'seq_len' must be a positive integer, got {meta.get('seq_len')!r}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        problems.append(f"'dtype' must be uint16 or uint32, got {meta.get('dtype')!r}")
    rows = meta.get("n_rows")
    if not (isinstance(rows, dict) and all(isinstance(rows.get(s), int) and rows[s] >= 0 for s in SPLITS)):
        problems.append(f"'n_rows' must map {' and '.join(SPLITS)} to row counts, got {rows!r}")
    if problems:
        raise UserError(str(meta_path), "; ".join(problems), fix)
    return meta


def check_enough_rows(n_rows: int, global_batch: int, split: str) -> None:
    """Raise unless the split holds at least one global batch (micro × grad_accum × world) of rows."""
    if n_rows < global_batch:
        raise UserError(
            f"{split} split",
            f"has {n_rows} rows, fewer than one global batch of {global_batch}",
            "prepare more data (or a smaller --seq-len), or lower micro_batch × grad_accum × world size",
        )


def _has_mask(meta: dict[str, Any]) -> bool:
    return meta["format"] == "chat"


class PackedDataset(Dataset):
    """Rows of one split, read lazily through ``np.memmap`` (safe to hand to DataLoader workers)."""

    def __init__(self, data_dir: Path | str, split: str) -> None:
        if split not in SPLITS:
            raise UserError("split", f"unknown split '{split}'", f"use one of {SPLITS}")
        self.meta = load_meta(data_dir)
        self.data_dir, self.split = Path(data_dir), split
        self.seq_len: int = self.meta["seq_len"]
        self.n_rows: int = self.meta["n_rows"][split]
        self._rows: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n_rows

    def _open(self) -> None:
        shape = (self.n_rows, self.seq_len + 1)
        tokens, mask = split_files(self.data_dir, self.split)
        self._rows = np.memmap(tokens, dtype=self.meta["dtype"], mode="r", shape=shape)
        if _has_mask(self.meta):
            self._mask = np.memmap(mask, dtype=np.uint8, mode="r", shape=shape)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """``input_ids`` = row[:-1]; ``labels`` = ``shift_labels`` = row[1:] with -100 where not trained."""
        if self._rows is None:
            self._open()
        row = torch.from_numpy(self._rows[i].astype(np.int64))
        targets = row[1:].clone()
        if self._mask is not None:
            targets[torch.from_numpy(self._mask[i, 1:] == 0)] = IGNORE_INDEX
        return {"input_ids": row[:-1], "labels": targets, "shift_labels": targets}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None, "_mask": None}


class GlobalBatchSampler:
    """Infinite iterator of micro-batches (lists of row indices) for one rank; same global batches for any world.

    Epoch ``e`` uses ``torch.randperm(n_rows, generator=Generator().manual_seed(seed + e))``. Optimizer step ``s``
    (counted across epochs; each epoch drops its incomplete tail) takes positions ``[j*G, (j+1)*G)`` of its epoch's
    permutation, ``j = s % steps_per_epoch``, ``G = micro × grad_accum × world``. Within that block rank ``r`` at
    micro-step ``k`` takes positions ``(k*world + r)*micro`` to ``+micro``. Every ``iter()`` starts at
    ``start_step``, so resuming is constructing it with the number of optimizer steps already done.
    """

    def __init__(
        self, n_rows: int, micro_batch: int, grad_accum: int, rank: int, world: int, seed: int, start_step: int = 0
    ) -> None:
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world", world)):
            if value < 1:
                raise UserError(name, f"must be at least 1, got {value}", f"set {name} to a positive integer")
        if not 0 <= rank < world or start_step < 0:
            raise UserError(
                "sampler",
                f"rank {rank} / world {world} / start_step {start_step} out of range",
                "pass 0 <= rank < world and start_step >= 0",
            )
        self.n_rows, self.micro_batch, self.grad_accum = n_rows, micro_batch, grad_accum
        self.rank, self.world, self.seed, self.start_step = rank, world, seed, start_step
        self.global_batch = micro_batch * grad_accum * world
        check_enough_rows(n_rows, self.global_batch, "train")
        self.steps_per_epoch = n_rows // self.global_batch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The row order of one epoch."""
        return torch.randperm(self.n_rows, generator=torch.Generator().manual_seed(self.seed + epoch))

    def global_batch_indices(self, step: int) -> list[int]:
        """All rows of optimizer step ``step``, over every rank and micro-step."""
        epoch, j = divmod(step, self.steps_per_epoch)
        return self.permutation(epoch)[j * self.global_batch : (j + 1) * self.global_batch].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        step, epoch, perm = self.start_step, -1, torch.empty(0, dtype=torch.long)
        while True:
            e, j = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, perm = e, self.permutation(e)
            for k in range(self.grad_accum):
                lo = j * self.global_batch + (k * self.world + self.rank) * self.micro_batch
                yield perm[lo : lo + self.micro_batch].tolist()
            step += 1


def make_train_loader(
    dataset: Dataset, sampler: GlobalBatchSampler, num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """An endless DataLoader of micro-batches in the sampler's order.

    Its workers ignore SIGTERM/SIGINT: a signal sent to the whole process group (SLURM, ``kill -TERM -PGID``,
    Ctrl-C) must reach the training process's save-and-exit path, not kill the worker it reads from. So the
    owner must stop them by dropping the loader's iterator (a plain SIGTERM at interpreter exit no longer does).
    """
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
    )


def _ignore_stop_signals(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def eval_indices(n_rows: int, rank: int, world: int, max_rows: int | None = None) -> list[int]:
    """This rank's share of the first ``max_rows`` rows (all if None): rows ``rank, rank + world, ...``.

    Across ranks every row appears exactly once; shares differ by at most one row, so reduce the summed loss and
    token counts once after the loop rather than per batch.
    """
    n = n_rows if max_rows is None else min(n_rows, max_rows)
    return list(range(rank, n, world))


def make_eval_loader(
    dataset: Dataset,
    micro_batch: int,
    rank: int,
    world: int,
    max_rows: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A finite, unshuffled DataLoader over this rank's share of the rows (see :func:`eval_indices`)."""
    shard = Subset(dataset, eval_indices(len(dataset), rank, world, max_rows))
    return DataLoader(shard, batch_size=micro_batch, shuffle=False, num_workers=num_workers, pin_memory=pin_memory)
