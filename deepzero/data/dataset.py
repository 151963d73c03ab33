"""Reading prepared data: sharded token rows on disk, a resumable global-batch sampler, and the loaders.

On-disk format (written by :mod:`deepzero.data.prepare`, ``format_version`` 2): ``<dir>/meta.json`` lists each
split's shards in order, ``meta["shards"][split] = [{"file": "train-00000.bin", "rows": n}, ...]``. A shard is a
raw C-order array of shape ``[rows, seq_len + 1]`` and dtype ``meta["dtype"]``; the split's rows are its shards'
rows in that order. Chat data adds a ``.mask.bin`` twin per shard (``train-00000.mask.bin``), uint8 of the same
shape: bit 0 (value 1) marks a training target (assistant text), bit 1 (value 2) the first token of a conversation.
Preference data (``format: preference``) has the same shards and masks, its rows in pairs
(:mod:`deepzero.data.preference`). Prompt data (``format: prompts``, GRPO) has rows of ``max_prompt_len`` tokens, one
prompt each, right-padded, mask bit 0 on the prompt's tokens, and each record's other fields in
``{split}.records.jsonl`` (:mod:`deepzero.data.prompts`).

Each row yields ``input_ids = row[:-1]`` and targets ``row[1:]``, already shifted. Transformers' causal-LM loss
shifts ``labels`` itself unless it is given ``shift_labels``, and it only computes a loss when ``labels`` is not None,
so a sample carries both keys holding the same shifted targets: ``model(**batch).loss`` is then the mean
cross-entropy of ``logits[:, t]`` against ``row[t + 1]`` over every position (tested for DeepseekV3ForCausalLM).

With ``documents=True`` (the default) a sample also carries ``position_ids`` that restart at 0 at each document
start inside the row (text: the token after an ``eos_token_id``; chat: mask bit 1), and the target of a document's
last position is -100 when the next token starts another document: no prediction across documents. The first
position of a row is 0 even when the row starts inside a document. ``documents=False`` is stream packing:
``position_ids = arange(seq_len)`` and no extra -100.

With ``vocab_size`` (the model's embedding rows) every row is checked as it is read: an id the model cannot embed
(a corrupted shard, data prepared with another tokenizer) is a :class:`UserError` naming the shard and row. The
loaders check every rank's rows of each micro-step on every rank (:class:`MicroBatch` ``peers``), so all ranks stop
at the same step with the same line, and carry the error out of their worker process as a value: torch re-raises
a worker's exception by calling its class with the traceback text, which would print that text.
"""

from __future__ import annotations

import bisect
import json
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from deepzero.errors import UserError

META_FILE = "meta.json"
FORMAT_VERSION = 2
"""1: one ``{split}.bin`` per split, 0/1 chat masks. 2: shards listed in meta.json, chat mask bit 1 = start."""
SPLITS = ("train", "val")
FORMATS = ("text", "chat", "preference", "prompts")
IGNORE_INDEX = -100
MASK_TARGET, MASK_START = 1, 2
_PREPARE = "run python data/prepare.py --input stdlib --tokenizer train --out {dir}"


def shard_files(data_dir: Path | str, name: str) -> tuple[Path, Path]:
    """The token file and the loss-mask twin (chat only) of one shard, e.g. ``train-00000.bin``."""
    d = Path(data_dir)
    stem = name.removesuffix(".bin")
    return d / f"{stem}.bin", d / f"{stem}.mask.bin"


def shard_name(split: str, index: int) -> str:
    """The token file name of a split's ``index``-th shard."""
    return f"{split}-{index:05d}.bin"


def load_meta(data_dir: Path | str) -> dict[str, Any]:
    """Read ``meta.json`` and check that every shard is there with the size it promises."""
    d = Path(data_dir)
    fix = _PREPARE.format(dir=d)
    if not d.is_dir():
        raise UserError(str(d), "no such data folder", fix)
    meta_path = d / META_FILE
    if not meta_path.is_file():
        raise UserError(str(meta_path), "missing, so the data folder was never prepared (or not finished)", fix)
    meta = _read_meta(meta_path, fix)
    row_len = row_length(meta)
    row_bytes = row_len * np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        for shard in meta["shards"][split]:
            tokens, mask = shard_files(d, shard["file"])
            expected = [(tokens, shard["rows"] * row_bytes)]
            if _has_mask(meta):
                expected.append((mask, shard["rows"] * row_len))
            for path, size in expected:
                if not path.is_file() or path.stat().st_size != size or size == 0:
                    found = path.stat().st_size if path.is_file() else "missing"
                    raise UserError(str(path), f"expected {size} bytes ({shard['rows']} rows), found {found}", fix)
    return meta


def _read_meta(meta_path: Path, fix: str) -> dict[str, Any]:
    """meta.json as a dict with the keys training reads, or one line naming what is wrong with it."""
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(str(meta_path), f"not valid JSON ({err})", fix) from None
    if isinstance(meta, dict) and meta.get("format_version", 1) != FORMAT_VERSION:
        raise UserError(
            str(meta_path),
            f"written in data format {meta.get('format_version', 1)}, this code reads format {FORMAT_VERSION} "
            "(sharded rows)",
            f"re-run python data/prepare.py with the same --input, --tokenizer and --seq-len and --out {meta_path.parent}",
        )
    problems = []
    if not isinstance(meta, dict):
        meta, problems = {}, ["top level is not a JSON object"]
    if not (isinstance(meta.get("seq_len"), int) and meta["seq_len"] > 0):
        problems.append(f"'seq_len' must be a positive integer, got {meta.get('seq_len')!r}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        problems.append(f"'dtype' must be uint16 or uint32, got {meta.get('dtype')!r}")
    if meta.get("format") not in FORMATS:
        problems.append(f"'format' must be one of {', '.join(FORMATS)}, got {meta.get('format')!r}")
    elif meta["format"] == "prompts" and not (
        isinstance(meta.get("max_prompt_len"), int) and meta["max_prompt_len"] > 0
    ):
        problems.append(f"'max_prompt_len' must be a positive integer, got {meta.get('max_prompt_len')!r}")
    if not isinstance(meta.get("tokenizer", ""), str):
        problems.append(f"'tokenizer' must be a folder or hub id (a string), got {meta.get('tokenizer')!r}")
    rows = meta.get("n_rows")
    if not (isinstance(rows, dict) and all(isinstance(rows.get(s), int) and rows[s] >= 0 for s in SPLITS)):
        problems.append(f"'n_rows' must map {' and '.join(SPLITS)} to row counts, got {rows!r}")
    elif not _shards_match(meta.get("shards"), rows):
        problems.append("'shards' must list each split's files and rows, adding up to 'n_rows'")
    if problems:
        raise UserError(str(meta_path), "; ".join(problems), fix)
    return meta


def _shards_match(shards: Any, rows: dict[str, int]) -> bool:
    if not isinstance(shards, dict):
        return False
    for split in SPLITS:
        listed = shards.get(split)
        if not isinstance(listed, list) or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("rows"), int) and s["rows"] > 0
            for s in listed
        ):
            return False
        if sum(s["rows"] for s in listed) != rows[split]:
            return False
    return True


def meta_header(fmt: str, seq_len: int, dtype: np.dtype, tok: Any) -> dict[str, Any]:
    """The first keys of a prepared folder's meta.json: format, row length, token dtype and the tokenizer's ids."""
    return {
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "seq_len": seq_len,
        "dtype": np.dtype(dtype).name,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def check_enough_rows(n_rows: int, global_batch: int, split: str) -> None:
    """Raise unless the split holds at least one global batch (micro × grad_accum × world) of rows."""
    if n_rows < global_batch:
        raise UserError(
            f"{split} split",
            f"has {n_rows} rows, fewer than one global batch of {global_batch}",
            "prepare more data (or a smaller --seq-len), or lower micro_batch × grad_accum × world size",
        )


def _has_mask(meta: dict[str, Any]) -> bool:
    return meta["format"] in ("chat", "preference", "prompts")


def row_length(meta: dict[str, Any]) -> int:
    """Tokens per stored row: ``seq_len + 1`` (a training row and its shifted targets), or for prompts (GRPO) the
    longest prompt, ``max_prompt_len`` (the completion is generated, never stored)."""
    return meta["max_prompt_len"] if meta["format"] == "prompts" else meta["seq_len"] + 1


class PackedDataset(Dataset):
    """Rows of one split over any number of shards, read lazily through ``np.memmap`` (picklable for DataLoader
    workers). Row ``i`` of the split is row ``i - start`` of the shard whose row range holds it."""

    rows_per_sample = 1
    """Rows one sample trains on (a preference pair: 2)."""
    collate = staticmethod(default_collate)
    """How the loaders stack a micro-batch's samples."""

    def __init__(self, data_dir: Path | str, split: str, documents: bool = True, vocab_size: int | None = None) -> None:
        if split not in SPLITS:
            raise UserError("split", f"unknown split '{split}'", f"use one of {SPLITS}")
        self.meta = load_meta(data_dir)
        self.data_dir, self.split, self.documents = Path(data_dir), split, documents
        self.seq_len: int = self.meta["seq_len"]
        self.row_len: int = row_length(self.meta)
        self.n_rows: int = self.meta["n_rows"][split]
        self.shards: list[dict[str, Any]] = self.meta["shards"][split]
        self.starts: list[int] = np.cumsum([0] + [s["rows"] for s in self.shards])[:-1].tolist()
        self.eos: int | None = self.meta.get("eos_token_id")
        self.vocab_size = vocab_size
        """Ids must be below it (the model's embedding rows); None: not checked."""
        self._rows: list[np.ndarray] | None = None
        self._mask: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n_rows

    def _open(self) -> None:
        self._rows, self._mask = [], []
        for shard in self.shards:
            shape = (shard["rows"], self.row_len)
            tokens, mask = shard_files(self.data_dir, shard["file"])
            # plain ndarray views of the maps: a row of an np.memmap costs ~5 us to index and ~20 us to reduce
            self._rows.append(np.memmap(tokens, dtype=self.meta["dtype"], mode="r", shape=shape).view(np.ndarray))
            if _has_mask(self.meta):
                self._mask.append(np.memmap(mask, dtype=np.uint8, mode="r", shape=shape).view(np.ndarray))

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Row ``i`` of the split (``row_len`` tokens) and its mask (chat, preference, prompts)."""
        if not 0 <= i < self.n_rows:
            raise IndexError(f"row {i} out of range for {self.n_rows} rows")
        if self._rows is None:
            self._open()
        k = bisect.bisect_right(self.starts, i) - 1
        j = i - self.starts[k]
        tokens = self._rows[k][j]
        if self.vocab_size is not None and (top := int(tokens.max())) >= self.vocab_size:
            self._bad_row(k, j, i, top)
        return tokens, (self._mask[k][j] if self._mask else None)

    def check_rows(self, indices: list[int]) -> None:
        """Raise the :class:`UserError` of the first of ``indices`` whose ids reach past ``vocab_size``."""
        if self.vocab_size is not None:
            for i in indices:
                self.row(int(i))

    def _bad_row(self, shard: int, j: int, i: int, top: int) -> None:
        tokens, _ = shard_files(self.data_dir, self.shards[shard]["file"])
        column = int(np.argmax(self._rows[shard][j] >= self.vocab_size))
        raise UserError(
            str(tokens),
            f"row {j} ({self.split} row {i}) holds token id {top} at column {column}, past the model's vocabulary"
            f" of {self.vocab_size} ids",
            "re-run data/prepare.py with the tokenizer of --model (a prepared shard that changed is corrupted)",
        )

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """``input_ids`` = row[:-1]; ``labels`` = ``shift_labels`` = row[1:] with -100 where not trained;
        ``position_ids`` per document (or ``arange`` with ``documents=False``)."""
        tokens, mask = self.row(int(i))
        row = tokens.astype(np.int64)
        ignore = np.zeros(self.seq_len, dtype=bool)
        if mask is not None:
            ignore |= (mask[1:] & MASK_TARGET) == 0
        positions = np.arange(self.seq_len, dtype=np.int64)
        if self.documents:
            starts = self._doc_starts(row, mask)  # per row position: a document starts here
            ignore |= starts[1:]  # the next token starts another document
            first = np.maximum.accumulate(np.where(starts[:-1], positions, 0))
            positions -= first
        targets = torch.from_numpy(np.where(ignore, IGNORE_INDEX, row[1:]))
        return {
            "input_ids": torch.from_numpy(row[:-1]),
            "labels": targets,
            "shift_labels": targets,
            "position_ids": torch.from_numpy(positions),
        }

    def _doc_starts(self, row: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """Over the ``seq_len + 1`` row positions: True where a document starts (position 0 excluded)."""
        if mask is not None:
            starts = (mask & MASK_START) != 0
        elif self.eos is not None:
            starts = np.zeros(len(row), dtype=bool)
            starts[1:] = row[:-1] == self.eos
        else:
            return np.zeros(len(row), dtype=bool)
        starts[0] = False
        return starts

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None, "_mask": None}


class MicroBatch(list):
    """One rank's row indices of a micro-step, and ``peers``: the rows of every rank in that micro-step, which
    the loader checks too (so that every rank stops at a bad row, not only the rank that trains on it)."""

    def __init__(self, rows: list[int], peers: list[int]) -> None:
        super().__init__(rows)
        self.peers = peers


@dataclass(frozen=True)
class _Failure:
    """A :class:`UserError` raised in a loader worker, carried to the loop as a batch and raised there."""

    where: str
    problem: str
    fix: str


class _Checked(Dataset):
    """What a loader reads: the dataset's samples of a micro-batch after checking its peers' rows, or a _Failure."""

    def __init__(self, dataset: PackedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]] | _Failure:
        try:
            self.dataset.check_rows(getattr(indices, "peers", []))
            return [self.dataset[i] for i in indices]
        except UserError as err:
            return _Failure(err.where, err.problem, err.fix)


def _collate(
    collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    samples: list[dict[str, torch.Tensor]] | _Failure,
) -> dict[str, torch.Tensor] | _Failure:
    return samples if isinstance(samples, _Failure) else collate(samples)


class _Loader(DataLoader):
    """A DataLoader over :class:`_Checked` whose iterator raises a worker's :class:`UserError` as one."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return _raise_failures(super().__iter__())


def _raise_failures(batches: Iterator[dict[str, torch.Tensor] | _Failure]) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        if isinstance(batch, _Failure):
            raise UserError(batch.where, batch.problem, batch.fix)
        yield batch


class GlobalBatchSampler:
    """Infinite iterator of micro-batches (lists of row indices) for one rank; same global batches for any world.

    Epoch ``e`` uses ``torch.randperm(n_rows, generator=Generator().manual_seed(seed + e))``. Optimizer step ``s``
    (counted across epochs; each epoch drops its incomplete tail) takes positions ``[j*G, (j+1)*G)`` of its epoch's
    permutation, ``j = s % steps_per_epoch``, ``G = micro × grad_accum × world``. Within that block rank ``r`` at
    micro-step ``k`` takes positions ``(k*world + r)*micro`` to ``+micro``. Every ``iter()`` starts at
    ``start_step``, so resuming is constructing it with the number of optimizer steps already done. Each
    micro-batch is a :class:`MicroBatch` whose ``peers`` are that micro-step's rows of every rank.
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
                block = j * self.global_batch + k * self.world * self.micro_batch  # micro-step k of every rank
                peers = perm[block : block + self.world * self.micro_batch].tolist()
                lo = self.rank * self.micro_batch
                yield MicroBatch(peers[lo : lo + self.micro_batch], peers)
            step += 1


def make_train_loader(
    dataset: PackedDataset, sampler: Iterable[list[int]], num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """An endless DataLoader of micro-batches in the sampler's order (a bad row raises its UserError here).

    Its workers ignore SIGTERM/SIGINT: a signal sent to the whole process group (SLURM, ``kill -TERM -PGID``,
    Ctrl-C) must reach the training process's save-and-exit path, not kill the worker it reads from. So the
    owner must stop them by dropping the loader's iterator (a plain SIGTERM at interpreter exit no longer does).
    """
    return _Loader(
        _Checked(dataset),
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=partial(_collate, dataset.collate),
        worker_init_fn=_ignore_stop_signals if num_workers else None,
    )


def _ignore_stop_signals(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def eval_sample(n_rows: int, max_rows: int | None = None, seed: int = 0) -> list[int]:
    """The rows an evaluation reads: all of them, or ``max_rows`` drawn from the whole split, in row order.

    The draw is the first ``max_rows`` of ``torch.randperm(n_rows)`` under ``seed``: the same rows at every eval and
    after a resume, for any world size, and a smaller ``max_rows`` (another world's rounding) reads a subset.
    """
    if max_rows is None or max_rows >= n_rows:
        return list(range(n_rows))
    perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))
    return sorted(perm[: max(max_rows, 0)].tolist())


def eval_indices(n_rows: int, rank: int, world: int, max_rows: int | None = None, seed: int = 0) -> list[int]:
    """This rank's share of :func:`eval_sample`: its rows ``rank, rank + world, ...``.

    Across ranks every sampled row appears exactly once; shares differ by at most one row, so reduce the summed
    loss and token counts once after the loop rather than per batch.
    """
    return eval_sample(n_rows, max_rows, seed)[rank::world]


def make_eval_loader(
    dataset: PackedDataset,
    micro_batch: int,
    rank: int,
    world: int,
    max_rows: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
) -> DataLoader:
    """A finite, unshuffled DataLoader over this rank's share of the sampled rows (see :func:`eval_indices`);
    each micro-batch also checks the rows the other ranks read at the same batch."""
    shares = [eval_indices(len(dataset), r, world, max_rows, seed) for r in range(world)]
    batches = [
        MicroBatch(shares[rank][lo : lo + micro_batch], [i for s in shares for i in s[lo : lo + micro_batch]])
        for lo in range(0, len(shares[rank]), micro_batch)
    ]
    return _Loader(
        _Checked(dataset),
        batch_sampler=batches,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=partial(_collate, dataset.collate),
    )
