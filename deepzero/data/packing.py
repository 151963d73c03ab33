"""Pack tokenized text and chat documents into the rows of each split's shards, and report the stream's progress."""

from __future__ import annotations

import resource
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepzero import progress
from deepzero.data.dataset import MASK_TARGET
from deepzero.data.tokenize_workers import Encoder, Task, encoded
from deepzero.data.writer import Layout, ShardWriter, check_rows
from deepzero.errors import UserError

_FLUSH_TOKENS = 1 << 22


@dataclass
class SplitStats:
    """What one split became."""

    n_docs: int = 0
    n_rows: int = 0
    n_tokens: int = 0
    """Tokens stored in rows, padding excluded."""
    n_target_tokens: int = 0
    """Tokens that are training targets (text: every next token of the stream)."""
    n_dropped: int = 0
    """Text: tail tokens that did not fill a row. Chat: conversations truncated to one row."""
    shards: list[dict[str, Any]] = field(default_factory=list)
    """``{"file": ..., "rows": ...}`` per shard, in order."""


class Progress:
    """A tqdm bar over input bytes (MB/s, and an ETA when the total is known) with tokens/s beside it."""

    def __init__(self, total_bytes: int | None) -> None:
        self.n_bytes = self.n_tokens = 0
        self.start, self.cpu_start = time.perf_counter(), _cpu_seconds()
        self.bar = progress.bar(
            total_bytes, tty_only=False, desc="prepare", unit="B", unit_scale=True, unit_divisor=1000, smoothing=0.1
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = _cpu_seconds() - self.cpu_start

    def update(self, n_bytes: int, n_tokens: int) -> None:
        self.n_bytes += n_bytes
        self.n_tokens += n_tokens
        self.bar.update(n_bytes)
        rate = self.n_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate / 1e6:.2f}M tok/s", refresh=False)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the workers, once the pool is shut down)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _TextRows:
    """Concatenates documents (eos already appended) and cuts the stream into rows; the last partial row is dropped."""

    def __init__(self, writer: ShardWriter) -> None:
        self.writer, self.row_len = writer, writer.layout.row_len
        self.parts: list[np.ndarray] = []
        self.buffered = self.n_tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        self.parts.append(ids)
        self.buffered += len(ids)
        self.n_tokens += len(ids)
        if self.buffered >= _FLUSH_TOKENS:
            self._flush()

    def has_rows(self) -> bool:
        return self.n_tokens >= self.row_len

    def _flush(self) -> None:
        stream = np.concatenate(self.parts) if self.parts else np.zeros(0, self.writer.layout.dtype)
        n = len(stream) // self.row_len
        self.writer.write(stream[: n * self.row_len].reshape(n, self.row_len))
        self.parts, self.buffered = [stream[n * self.row_len :]], len(stream) - n * self.row_len

    def finish(self, stats: SplitStats) -> None:
        self._flush()
        self.writer.close()
        stats.n_rows = self.writer.n_rows
        stats.n_tokens = stats.n_rows * self.row_len
        stats.n_target_tokens = stats.n_rows * (self.row_len - 1)
        stats.n_dropped = self.n_tokens - stats.n_tokens


class _ChatRows:
    """Packs whole conversations into rows; a row is padded (mask 0) when the next does not fit."""

    def __init__(self, writer: ShardWriter, pad: int) -> None:
        self.writer, self.row_len, self.pad = writer, writer.layout.row_len, pad
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.used = self.n_tokens = self.n_targets = self.n_truncated = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        self.n_truncated += len(ids) > self.row_len
        ids, mask = ids[: self.row_len], mask[: self.row_len]
        if self.used + len(ids) > self.row_len:
            self._flush()
        self.ids.append(ids)
        self.masks.append(mask)
        self.used += len(ids)
        self.n_tokens += len(ids)
        self.n_targets += int(np.count_nonzero(mask & MASK_TARGET))

    def has_rows(self) -> bool:
        return self.n_tokens > 0

    def _flush(self) -> None:
        if not self.used:
            return
        fill = self.row_len - self.used
        row = np.concatenate([*self.ids, np.full(fill, self.pad)])
        mask = np.concatenate([*self.masks, np.zeros(fill, np.uint8)])
        self.writer.write(row[None], mask[None])
        self.ids, self.masks, self.used = [], [], 0

    def finish(self, stats: SplitStats) -> None:
        self._flush()
        self.writer.close()
        stats.n_rows, stats.n_tokens, stats.n_target_tokens = self.writer.n_rows, self.n_tokens, self.n_targets
        stats.n_dropped = self.n_truncated


class _Holdback:
    """The last train documents, just enough for one row (text: ``row_len`` tokens; chat: one conversation).

    They are written to train at the end, unless val got no row: then they become val's (see :mod:`deepzero.data.prepare`)."""

    def __init__(self, need: int, chat: bool) -> None:
        self.need, self.chat = need, chat
        self.docs: deque[tuple[np.ndarray, np.ndarray | None]] = deque()
        self.tokens = 0

    def push(self, doc: tuple[np.ndarray, np.ndarray | None]) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Hold ``doc``; release (yield) the oldest held documents that are no longer needed."""
        self.docs.append(doc)
        self.tokens += len(doc[0])
        while len(self.docs) > 1 and (self.chat or self.tokens - len(self.docs[0][0]) >= self.need):
            old = self.docs.popleft()
            self.tokens -= len(old[0])
            yield old


def write_splits(
    tasks: Iterable[Task],
    encoder: Encoder,
    workers: int,
    layout: Layout,
    chat: bool,
    pad: int,
    progress: Progress,
    given_val: bool = False,
) -> dict[str, SplitStats]:
    """Tokenize the batches in the worker pool and write both splits' shards; return what each became. With
    ``given_val`` (``--val-input``) no train document is moved to val."""
    stats = {s: SplitStats() for s in ("train", "val")}
    rows = {
        s: (_ChatRows(ShardWriter(layout, s, True), pad) if chat else _TextRows(ShardWriter(layout, s, False)))
        for s in stats
    }
    held = _Holdback(layout.row_len, chat)
    for n_bytes, batch in encoded(tasks, encoder, workers):
        for doc in batch["val"].docs():
            rows["val"].add(*doc)
        for doc in batch["train"].docs():
            for released in held.push(doc):
                rows["train"].add(*released)
        for split, enc in batch.items():
            stats[split].n_docs += len(enc.lengths)
        progress.update(n_bytes, sum(len(enc.ids) for enc in batch.values()))
    n_docs = stats["train"].n_docs + stats["val"].n_docs
    if n_docs < 2:
        raise UserError("--input", f"only {n_docs} document, cannot split train/val by document", "pass more documents")
    to = "train" if rows["val"].has_rows() or given_val else "val"
    for doc in held.docs:
        rows[to].add(*doc)
    if to == "val":
        stats["train"].n_docs -= len(held.docs)
        stats["val"].n_docs += len(held.docs)
    for split in stats:
        rows[split].finish(stats[split])
        stats[split].shards = rows[split].writer.shards
        fix = "add documents to --val-input, or lower --seq-len" if given_val and split == "val" else None
        check_rows(stats[split].n_rows, split, layout.row_len, fix)
    return stats
