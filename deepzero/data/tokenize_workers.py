"""Tokenize batches of text and chat documents in worker processes; encodings come back in input order."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

import numpy as np
from transformers import PreTrainedTokenizerBase

from deepzero.data.chat_render import ChatRenderer
from deepzero.data.dataset import MASK_START, MASK_TARGET
from deepzero.data.sources import Chat, Doc
from deepzero.data.writer import split_of
from deepzero.errors import UserError

BATCH_BYTES = 1 << 20
"""Input bytes per batch handed to a worker (a batch also ends at ``BATCH_DOCS`` documents)."""
BATCH_DOCS = 4096
IN_FLIGHT_PER_WORKER = 4
"""Batches submitted ahead per worker: enough to keep them busy, few enough to bound memory."""


@dataclass
class _Encoded:
    """One batch's documents of one split, in input order: tokens (and chat masks) concatenated, and lengths."""

    ids: np.ndarray
    lengths: list[int]
    mask: np.ndarray | None

    def docs(self) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        lo = 0
        for n in self.lengths:
            yield self.ids[lo : lo + n], (None if self.mask is None else self.mask[lo : lo + n])
            lo += n


@dataclass
class Encoder:
    """What a worker needs to turn a batch of documents into token ids, per split."""

    tok: PreTrainedTokenizerBase
    renderer: ChatRenderer | None
    """Chat data's renderer (None: plain text)."""
    seed: int
    val_fraction: float | None
    dtype: str
    prefix: tuple[int, ...] = ()
    """Put before every document (see :func:`deepzero.data.writer.doc_prefix`)."""
    to: str | None = None
    """The split every document goes to (set per batch in a ``--val-input`` run), or None: where its hash puts it."""

    def __call__(self, values: list[str | Chat]) -> dict[str, _Encoded]:
        split = [self.to or split_of(v, self.seed, self.val_fraction) for v in values]
        out, chat = {}, self.renderer is not None
        for name in ("train", "val"):
            part = [v for v, s in zip(values, split, strict=True) if s == name]
            pieces = _encode_chats(self.renderer, part, self.prefix) if chat else self._encode_texts(part)
            ids = np.concatenate([p for p, _ in pieces]) if pieces else np.zeros(0, self.dtype)
            mask = np.concatenate([m for _, m in pieces]) if chat and pieces else None
            out[name] = _Encoded(ids.astype(self.dtype, copy=False), [len(p) for p, _ in pieces], mask)
        return out

    def _encode_texts(self, texts: list[str]) -> list[tuple[np.ndarray, None]]:
        eos = self.tok.eos_token_id
        return [(np.array([*self.prefix, *ids, eos], dtype=self.dtype), None) for ids in _encode(self.tok, texts)]


_WORKER: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    """Each worker tokenizes on one thread (the pool is the parallelism); Ctrl-C is the parent's to handle."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = encoder


def _work(task: Task) -> tuple[int, dict[str, _Encoded] | tuple[str, str, str]]:
    """One batch → its encodings; a UserError comes back as a tuple (it does not survive pickling)."""
    n_bytes, values, to = task
    try:
        return n_bytes, replace(_WORKER, to=to)(values)
    except UserError as e:
        return n_bytes, (e.where, e.problem, e.fix)


def _encode(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _encode_chats(
    renderer: ChatRenderer, chats: list[Chat], prefix: tuple[int, ...] = ()
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and a mask per conversation: bit 0 on tokens that start inside a target assistant turn
    (:mod:`deepzero.data.chat_render`), bit 1 on the conversation's first token. ``prefix`` goes first unless the
    rendering already starts with it (a template that writes ``bos_token``)."""
    if not chats:
        return []
    tok = renderer.tok
    rendered = [renderer.spans(chat) for chat in chats]
    encodings = tok.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for enc, (_, spans) in zip(encodings, rendered, strict=True):
        starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = MASK_TARGET
        ids = np.array(enc.ids, dtype=np.int64)
        if prefix and tuple(enc.ids[: len(prefix)]) != prefix:
            ids = np.concatenate([np.array(prefix, dtype=np.int64), ids])
            mask = np.concatenate([np.zeros(len(prefix), dtype=np.uint8), mask])
        if len(mask):
            mask[0] |= MASK_START
        out.append((ids, mask))
    return out


Task = tuple[int, list[str | Chat], str | None]
"""A batch for a worker: its input bytes, its documents' values, and the split they all go to (None: by hash)."""


def batches(docs: Iterable[Doc], to: str | None) -> Iterator[Task]:
    """Consecutive documents grouped into batches of about ``BATCH_BYTES``, all going to split ``to`` (None: each
    where its hash puts it)."""
    values: list[str | Chat] = []
    n_bytes = 0
    for doc in docs:
        values.append(doc.value)
        n_bytes += doc.nbytes
        if n_bytes >= BATCH_BYTES or len(values) >= BATCH_DOCS:
            yield n_bytes, values, to
            values, n_bytes = [], 0
    if values:
        yield n_bytes, values, to


@contextlib.contextmanager
def _pool(workers: int, encoder: Encoder) -> Iterator[ProcessPoolExecutor]:
    """Worker processes holding the encoder (forked where the platform can: no tokenizer pickling).

    A worker that dies (killed for memory) fails the run instead of hanging it; on any error the workers are
    stopped at once."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read at fork time: no "parallelism already used" warning
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(encoder,))
    try:
        yield pool
    except BaseException:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):  # no public way to stop them now
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encoded(tasks: Iterable[Task], encoder: Encoder, workers: int) -> Iterator[tuple[int, dict[str, _Encoded]]]:
    """Encodings of every batch, in input order; at most ``IN_FLIGHT_PER_WORKER`` batches per worker pending."""
    with _pool(workers, encoder) as pool:
        pending: deque[Future] = deque()
        for task in tasks:
            pending.append(pool.submit(_work, task))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())


def _result(future: Future) -> tuple[int, dict[str, _Encoded]]:
    try:
        n_bytes, value = future.result()
    except BrokenProcessPool as e:
        raise UserError(
            "--workers",
            "a tokenizer process died (killed by the system, out of memory?)",
            "use fewer --workers, or split very large documents",
        ) from e
    if isinstance(value, tuple):
        raise UserError(*value)
    return n_bytes, value
