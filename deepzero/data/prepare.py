"""Tokenize documents and pack them into fixed-length rows, in shards; streaming, parallel, deterministic.

    python -m deepzero.data.prepare --input stdlib --tokenizer train --seq-len 256 --out artifacts/data/stdlib

Documents stream from the readers (:mod:`deepzero.data.sources`) in numbered batches of about 1 MB to ``--workers``
processes (default: every core) that tokenize them; results are taken back in batch order, so the output is the
same byte for byte whatever the worker count, and only a few batches per worker are ever in memory. A document
goes to val when a hash of (seed, its content) falls below ``--val-fraction``, so the split needs no corpus size;
if no val row comes of that (a tiny corpus), the last train documents, enough for one row, go to val instead. With
``--val-input`` (a given held-out set) val is made of those inputs' documents only and train of ``--input``'s, with
the same tokenizer, format and row layout.

Plain text: every document is tokenized, gets what the tokenizer itself puts first (its post-processor's prefix:
``<bos>`` for DeepSeek's tokenizer, nothing for ``--tokenizer train``'s) prepended and ``<eos>`` appended, and the
stream is cut into rows of ``seq_len + 1`` tokens (the trailing remainder is dropped). Chat (``messages`` JSONL):
each conversation is rendered with the tokenizer's chat template (the same prefix is prepended unless the template
already starts with it), only assistant turns (their text and closing token) are marked as targets (mask bit 0),
the first token of each conversation is marked as a start (mask bit 1), and conversations are packed whole into
rows (one longer than a row is truncated), the rest of a row being padding. Preference pairs (``--format
preference``): :mod:`deepzero.data.preference`. Rows go to shards of at most
``--shard-mb`` each, written in a temp folder that is renamed into place at the end: a failed or killed run
publishes nothing. ``--tokenizer train`` trains a BPE on the first ``--tokenizer-sample-mb`` of train documents.
See :mod:`deepzero.data.dataset` for the on-disk format.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deepzero import progress
from deepzero.data.chat_render import ChatRenderer, chat_renderer
from deepzero.data.dataset import (
    FORMAT_VERSION,
    MASK_START,
    MASK_TARGET,
    META_FILE,
    load_meta,
    meta_header,
)
from deepzero.data.sources import (
    Chat,
    Doc,
    Format,
    doc_text,
    input_bytes,
    inputs_digest,
    iter_docs,
    parse_columns,
)
from deepzero.data.tokenizer import identity, train_tokenizer_from_texts
from deepzero.data.writer import (
    BadInput,
    Layout,
    Provenance,
    ShardWriter,
    check_rows,
    check_tokenizer,
    doc_prefix,
    publish_with_meta,
    remove_stale_temps,
    split_of,
    tokenizer_ref,
)
from deepzero.errors import UserError

BATCH_BYTES = 1 << 20
"""Input bytes per batch handed to a worker (a batch also ends at ``BATCH_DOCS`` documents)."""
BATCH_DOCS = 4096
IN_FLIGHT_PER_WORKER = 4
"""Batches submitted ahead per worker: enough to keep them busy, few enough to bound memory."""
DEFAULT_SHARD_MB = 256
DEFAULT_VAL_FRACTION = 0.02
FORMATS = ("auto", "text", "chat", "alpaca", "sharegpt", "preference", "prompts")
TOKENIZER_SAMPLE_MB = 64
_FLUSH_TOKENS = 1 << 22
_TOKENIZER_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model", ".tiktoken"})
_DOC_LAYOUT = "tokenizer prefix + ids + eos"
"""What a text document becomes; part of the fingerprint, so data prepared before the prefix is rebuilt."""


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


def prepare(
    inputs: Sequence[str],
    out: Path | str,
    tokenizer: str = "train",
    seq_len: int = 256,
    val_fraction: float | None = None,
    fmt: Format = "auto",
    vocab_size: int = 4096,
    seed: int = 0,
    force: bool = False,
    workers: int | None = None,
    shard_mb: float = DEFAULT_SHARD_MB,
    skip_bad: bool = False,
    tokenizer_sample_mb: float = TOKENIZER_SAMPLE_MB,
    val_inputs: Sequence[str] = (),
    max_completion_length: int | None = None,
    columns: dict[str, str] | None = None,
    chat_template: str | None = None,
    prompt_template: str | None = None,
) -> dict[str, Any]:
    """Build ``out`` (see module docstring) unless it is already up to date; return its ``meta.json`` contents.

    The val split is ``val_inputs``' documents when given, else drawn from ``inputs`` by hash with ``val_fraction``
    (default ``DEFAULT_VAL_FRACTION``); giving both is an error. ``max_completion_length`` (``--format prompts``
    only; default ``seq_len // 2``) is the part of ``seq_len`` left to the generated completion. ``columns`` maps the
    fields a format reads to the input's field names (``{"prompt": "question"}``). ``chat_template`` (a name or a
    file) renders chat data instead of the tokenizer's training template (:mod:`deepzero.data.chat_render`)."""
    out = Path(out)
    workers = workers or len(os.sched_getaffinity(0))
    val_fraction = _val_fraction(val_fraction, val_inputs)
    _check_args(seq_len, val_fraction, fmt, workers, shard_mb)
    _check_templates(fmt, chat_template, prompt_template)
    max_completion_length = _completion_length(fmt, seq_len, max_completion_length)
    settings: dict[str, Any] = {"shard_mb": shard_mb, "skip_bad": skip_bad}
    if columns:
        settings["columns"] = columns
    if prompt_template:
        settings["prompt_template"] = prompt_template
    if chat_template:
        settings["chat_template"] = chat_template
        if Path(chat_template).is_file():
            settings["chat_template_sha256"] = _sha(Path(chat_template).read_text(encoding="utf-8"))
    if max_completion_length is not None:
        settings["max_completion_length"] = max_completion_length
    if tokenizer == "train":
        settings["tokenizer_sample_mb"] = tokenizer_sample_mb
    if val_inputs:
        settings["val_inputs"] = inputs_digest(val_inputs, "--val-input")
    fingerprint = _fingerprint(inputs, tokenizer, seq_len, val_fraction, fmt, vocab_size, seed, settings)
    old = _existing_meta(out)
    if old is not None and old.get("fingerprint") == fingerprint and not force and _files_intact(out):
        print(f"prepare: {out} up to date ({old['n_rows']['train']} train / {old['n_rows']['val']} val rows)")
        return old
    start = time.perf_counter()
    loaded = None if tokenizer == "train" else _load_tokenizer(tokenizer)
    if fmt == "preference":
        from deepzero.data.preference import prepare_pairs

        args = (seq_len, val_fraction, vocab_size, seed, skip_bad, fingerprint)
        return prepare_pairs(inputs, out, loaded, tokenizer, *args, val_inputs=val_inputs, columns=columns)
    if fmt == "prompts":
        from deepzero.data.prompts import prepare_prompts

        args = (seq_len, max_completion_length, val_fraction, vocab_size, seed, skip_bad, fingerprint)
        return prepare_prompts(
            inputs, out, loaded, tokenizer, *args, val_inputs=val_inputs, columns=columns, shard_mb=shard_mb,
            prompt_template=prompt_template,
        )  # fmt: skip
    total_bytes = input_bytes([*inputs, *val_inputs])
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    bad = BadInput(skip_bad)
    try:
        if loaded is None:
            sample = int(tokenizer_sample_mb * 2**20)
            tok, tok_ref = _train_tokenizer(
                inputs, fmt, seed, val_fraction, vocab_size, sample, skip_bad, out, tmp, columns
            )
        else:
            tok, tok_ref = loaded, tokenizer_ref(tokenizer, out, tmp)
        docs = iter_docs(inputs, fmt, bad, columns=columns)
        first = next(docs)
        chat = not isinstance(first.value, str)
        if chat_template is not None and not chat:
            raise UserError("--chat-template", f"applies to chat data; {first.where} is plain text", "drop it")
        tasks = _batches(_chain(first, docs), None if val_fraction is not None else "train")
        if val_inputs:
            tasks = itertools.chain(tasks, _batches(_held_out(val_inputs, fmt, chat, bad, columns), "val"))
        check_tokenizer(tok, tokenizer, chat)
        dtype = np.dtype(np.uint16 if len(tok) < 2**16 else np.uint32)
        prefix = doc_prefix(tok)
        renderer = chat_renderer(tok, tokenizer, chat_template) if chat else None
        encoder = _Encoder(tok, renderer, seed, val_fraction, dtype.name, prefix)
        layout = Layout(tmp, seq_len + 1, dtype, max(1, int(shard_mb * 2**20) // ((seq_len + 1) * dtype.itemsize)))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with _Progress(total_bytes) as progress:
            stats = _write_splits(tasks, encoder, workers, layout, chat, pad, progress, given_val=bool(val_inputs))
        meta = {
            **meta_header("chat" if chat else "text", seq_len, dtype, tok),
            "doc_prefix_ids": list(prefix),
            "n_docs": {s: v.n_docs for s, v in stats.items()},
            "n_rows": {s: v.n_rows for s, v in stats.items()},
            "n_tokens": {s: v.n_tokens for s, v in stats.items()},
            "n_target_tokens": {s: v.n_target_tokens for s, v in stats.items()},
            "n_dropped": {s: v.n_dropped for s, v in stats.items()},
            "shards": {s: v.shards for s, v in stats.items()},
            "mask_bits": {"target": MASK_TARGET, "doc_start": MASK_START} if chat else None,
            "chat_template": renderer and {"source": renderer.source, "sha256": _sha(renderer.template)},
            **Provenance(
                tok_ref, inputs, val_inputs, columns, val_fraction, seed, fingerprint, start, identity(tok)
            ).meta(bad),
            "input_bytes": progress.n_bytes,
            "shard_mb": shard_mb,
            "stream_seconds": round(progress.seconds, 2),
            "stream_cpu_seconds": round(progress.cpu_seconds, 2),
        }
        publish_with_meta(tmp, out, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(_summary(meta, out, progress, workers))
    return meta


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _chain(first: Doc, rest: Iterator[Doc]) -> Iterator[Doc]:
    yield first
    yield from rest


def _held_out(
    val_inputs: Sequence[str], fmt: Format, chat: bool, bad: BadInput, columns: dict[str, str] | None = None
) -> Iterator[Doc]:
    """The documents of ``--val-input``; they must be of the kind of ``--input``'s (chat or plain text). The first
    is read at once, so a missing or mismatched input fails before the train inputs are tokenized."""
    docs = iter_docs(val_inputs, fmt, bad, flag="--val-input", columns=columns)
    first = next(docs)
    if isinstance(first.value, str) == chat:
        kinds = ("plain text", "chat 'messages'")
        raise UserError(
            f"--val-input {first.where}",
            f"holds {kinds[not chat]} while --input holds {kinds[chat]}",
            "give --val-input documents of the same format as --input",
        )
    return _chain(first, docs)


def _val_fraction(val_fraction: float | None, val_inputs: Sequence[str]) -> float | None:
    """The hash split's fraction, or None when the val split is ``--val-input`` (then both flags is an error)."""
    if not val_inputs:
        return DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    if val_fraction is not None:
        raise UserError(
            "--val-input and --val-fraction",
            "cannot be used together: val is either the --val-input documents or a fraction of --input's drawn by hash",
            "drop one of them",
        )
    return None


def _completion_length(fmt: str, seq_len: int, max_completion_length: int | None) -> int | None:
    """``--max-completion-length`` checked: prompts only, default ``seq_len // 2``, leaving a prompt 1+ tokens."""
    if fmt != "prompts":
        if max_completion_length is not None:
            raise UserError(
                "--max-completion-length",
                f"applies to --format prompts only (this is --format {fmt})",
                "drop --max-completion-length",
            )
        return None
    if max_completion_length is None:
        return seq_len // 2
    if not 0 < max_completion_length < seq_len:
        raise UserError(
            "--max-completion-length",
            f"must be between 1 and --seq-len - 1 = {seq_len - 1}, got {max_completion_length}",
            f"pass e.g. --max-completion-length {seq_len // 2}: prompt and completion share --seq-len",
        )
    return max_completion_length


def _check_args(seq_len: int, val_fraction: float | None, fmt: str, workers: int, shard_mb: float) -> None:
    if seq_len < 1:
        raise UserError("--seq-len", f"must be positive, got {seq_len}", "pass e.g. --seq-len 256")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise UserError("--val-fraction", f"must be between 0 and 1, got {val_fraction}", "pass e.g. 0.02")
    if fmt not in FORMATS:
        raise UserError("--format", f"unknown format '{fmt}'", f"use one of {', '.join(FORMATS)}")
    if workers < 1:
        raise UserError("--workers", f"must be at least 1, got {workers}", "pass e.g. --workers 4, or leave it out")
    if not shard_mb > 0:
        raise UserError("--shard-mb", f"must be positive, got {shard_mb}", f"pass e.g. --shard-mb {DEFAULT_SHARD_MB}")


def _check_templates(fmt: str, chat_template: str | None, prompt_template: str | None) -> None:
    """Each template flag belongs to one kind of data: given with another, it would be ignored."""
    if prompt_template is not None and fmt != "prompts":
        raise UserError("--prompt-template", f"applies to --format prompts, not {fmt}", "drop it, or prepare prompts")
    if chat_template is not None and fmt in ("text", "preference", "prompts"):
        raise UserError("--chat-template", f"applies to chat data, not --format {fmt}", "drop it")


def _fingerprint(
    inputs: Sequence[str],
    tokenizer: str,
    seq_len: int,
    val_fraction: float | None,
    fmt: str,
    vocab_size: int,
    seed: int,
    settings: dict[str, Any],
) -> str:
    """Hash of everything the output depends on: inputs (paths, sizes, mtimes), tokenizer, and the settings."""
    blob = {
        "version": FORMAT_VERSION,
        "inputs": inputs_digest(inputs),
        "tokenizer": _tokenizer_fingerprint(tokenizer, vocab_size),
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "format": fmt,
        "seed": seed,
        "layout": _DOC_LAYOUT,
        **settings,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer_fingerprint(tokenizer: str, vocab_size: int) -> dict[str, Any]:
    if tokenizer == "train":
        return {"train": vocab_size}
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        return {"hub": tokenizer}
    digest = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in _TOKENIZER_SUFFIXES:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return {"dir": digest.hexdigest()}


def _existing_meta(out: Path) -> dict[str, Any] | None:
    """The meta of a previous run in ``out``; refuses to later replace a folder that is not a prepared dataset."""
    if not out.exists():
        return None
    meta_path = out / META_FILE
    if out.is_dir() and meta_path.is_file():
        try:
            return json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            return None
    if out.is_dir() and not any(out.iterdir()):
        return None
    raise UserError(f"--out {out}", "exists and is not a prepared data folder (no meta.json)", "pick another --out")


def _files_intact(out: Path) -> bool:
    try:
        load_meta(out)
    except UserError:
        return False
    return True


def _load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer folder or a hub id; a path that is not a folder fails at once (no hub retries)."""
    looks_local = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or Path(spec).exists()
    if looks_local and not Path(spec).expanduser().is_dir():
        raise UserError(f"--tokenizer {spec}", "no such tokenizer folder", "pass a saved tokenizer folder or 'train'")
    try:
        return AutoTokenizer.from_pretrained(str(Path(spec).expanduser()) if looks_local else spec)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--tokenizer {spec}",
            f"could not load it ({first_line})",
            "pass a saved tokenizer folder, a hub id in the local cache, or 'train'",
        ) from e


def _train_tokenizer(
    inputs: Sequence[str],
    fmt: Format,
    seed: int,
    val_fraction: float | None,
    vocab_size: int,
    sample_bytes: int,
    skip_bad: bool,
    out: Path,
    tmp: Path,
    columns: dict[str, str] | None = None,
) -> tuple[PreTrainedTokenizerBase, str]:
    """Train on the first ``sample_bytes`` of train documents (message contents for chat) into ``<out>/tokenizer``;
    with ``val_fraction`` None (a ``--val-input`` run) every document of ``inputs`` is a train document.

    A first streaming pass over the inputs, stopped once the sample is read: bounded memory for any corpus. Bad
    input met here stops the run unless ``--skip-bad`` (it is counted in the main pass)."""

    def texts() -> Iterator[str]:
        used = 0
        for doc in iter_docs(inputs, fmt, on_bad=BadInput(skip_bad), columns=columns):
            if val_fraction is None or split_of(doc.value, seed, val_fraction) == "train":
                yield doc_text(doc.value)
                used += doc.nbytes
                if used >= sample_bytes:
                    return

    tok = train_tokenizer_from_texts(texts(), vocab_size, tmp / "tokenizer")
    ref = str(out.resolve() / "tokenizer")
    print(f"prepare: trained a byte-level BPE tokenizer, vocab {len(tok)} -> {ref}")
    return tok, ref


# --- bad input and progress ----------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar over input bytes (MB/s, and an ETA when the total is known) with tokens/s beside it."""

    def __init__(self, total_bytes: int | None) -> None:
        self.n_bytes = self.n_tokens = 0
        self.start, self.cpu_start = time.perf_counter(), _cpu_seconds()
        self.bar = progress.bar(
            total_bytes, tty_only=False, desc="prepare", unit="B", unit_scale=True, unit_divisor=1000, smoothing=0.1
        )

    def __enter__(self) -> _Progress:
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


# --- tokenizing in worker processes --------------------------------------------------------------------------------


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
class _Encoder:
    """What a worker needs to turn a batch of documents into token ids, per split."""

    tok: PreTrainedTokenizerBase
    renderer: ChatRenderer | None
    """Chat data's renderer (None: plain text)."""
    seed: int
    val_fraction: float | None
    dtype: str
    prefix: tuple[int, ...] = ()
    """Put before every document (see :func:`doc_prefix`)."""
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


_WORKER: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    """Each worker tokenizes on one thread (the pool is the parallelism); Ctrl-C is the parent's to handle."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = encoder


def _work(task: _Task) -> tuple[int, dict[str, _Encoded] | tuple[str, str, str]]:
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


_Task = tuple[int, list[str | Chat], str | None]
"""A batch for a worker: its input bytes, its documents' values, and the split they all go to (None: by hash)."""


def _batches(docs: Iterable[Doc], to: str | None) -> Iterator[_Task]:
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
def _pool(workers: int, encoder: _Encoder) -> Iterator[ProcessPoolExecutor]:
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


def _encoded(tasks: Iterable[_Task], encoder: _Encoder, workers: int) -> Iterator[tuple[int, dict[str, _Encoded]]]:
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


# --- writing rows into shards --------------------------------------------------------------------------------------


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

    They are written to train at the end, unless val got no row: then they become val's (see the module doc)."""

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


def _write_splits(
    tasks: Iterable[_Task],
    encoder: _Encoder,
    workers: int,
    layout: Layout,
    chat: bool,
    pad: int,
    progress: _Progress,
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
    for n_bytes, batch in _encoded(tasks, encoder, workers):
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


# --- publishing and reporting ----------------------------------------------------------------------------------------


def _summary(meta: dict[str, Any], out: Path, progress: _Progress, workers: int) -> str:
    """One screen: what went in, what came out, how fast."""
    n = {k: meta[k] for k in ("n_docs", "n_tokens", "n_rows", "n_dropped")}
    shards = {s: len(v) for s, v in meta["shards"].items()}
    dropped = "tail tokens" if meta["format"] == "text" else "conversations truncated to a row"
    secs = max(progress.seconds, 1e-9)
    skipped = meta["skipped"]
    rule = f"hash of seed {meta['seed']} and content < {meta['val_fraction']}"
    if meta["val_inputs"]:
        rule = f"val from --val-input {' '.join(meta['val_inputs'])}"
    lines = [
        f"prepare: wrote {out} in {meta['seconds']:.1f} s",
        f"  input     {progress.n_bytes / 1e6:,.1f} MB, {sum(n['n_docs'].values()):,} {meta['format']} documents"
        f" from {len(meta['inputs']) + len(meta['val_inputs'])} input(s); {skipped['count']} bad input(s) skipped",
        f"  split     train {n['n_docs']['train']:,} / val {n['n_docs']['val']:,} documents ({rule})",
        f"  tokens    train {n['n_tokens']['train']:,} / val {n['n_tokens']['val']:,}"
        f" ({meta['n_target_tokens']['train']:,} train targets)",
        f"  rows      train {n['n_rows']['train']:,} / val {n['n_rows']['val']:,} of {meta['seq_len'] + 1}"
        f" {meta['dtype']} in {shards['train']} + {shards['val']} shard(s)",
        f"  dropped   train {n['n_dropped']['train']:,} / val {n['n_dropped']['val']:,} {dropped}",
        f"  speed     {progress.n_bytes / 1e6 / secs:.2f} MB/s, {progress.n_tokens / secs / 1e6:.2f} M tokens/s"
        f" with {workers} worker(s)",
    ]
    lines += [f"  skipped   {line}" for line in skipped["first"]]
    return "\n".join(lines)


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose bad-flag message is a UserError (one ``error:`` line with a fix, exit code 2; no usage block)."""

    def error(self, message: str) -> NoReturn:
        raise UserError("data/prepare.py", message, "see python data/prepare.py --help")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m deepzero.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", default=["stdlib"], help="paths, 'stdlib', or hf:NAME[:CONFIG][:SPLIT]")
    p.add_argument("--tokenizer", default="train", help="saved tokenizer folder, hub id, or 'train'")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sample (rows hold seq_len + 1)")
    p.add_argument("--out", default="artifacts/data/stdlib", help="output folder")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help=f"fraction of documents held out (by hash; default {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument(
        "--val-input",
        nargs="+",
        default=(),
        help="the val split's own inputs (same kinds as --input), instead of --val-fraction",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=list(FORMATS),
        help="plain text, chat SFT (messages, ShareGPT conversations, Alpaca instruction/input/output, or"
        " prompt/completion; detected), alpaca or sharegpt by name, preference pairs (prompt/chosen/rejected"
        " JSONL), or prompts (GRPO: prompt + fields for the rewards)",
    )
    p.add_argument(
        "--max-completion-length",
        type=int,
        default=None,
        help="--format prompts: tokens of --seq-len left to the completion (default seq_len // 2); a longer prompt"
        " than seq_len - this is a bad record",
    )
    p.add_argument(
        "--columns",
        default=None,
        help="FIELD=INPUT_FIELD,...: read a format's field from another input field (e.g. prompt=question)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="chat data: render with this template (r1-distill-training, deepseek-v3-training, or a Jinja file) instead"
        " of the tokenizer's (TRL's training variant where TRL has one); see docs/sft.md",
    )
    p.add_argument(
        "--prompt-template",
        default=None,
        help="--format prompts: wrap each prompt as a user turn of this template, rendered with the tokenizer's chat"
        " template: r1-math (R1's 'Please reason step by step, and put your final answer within \\boxed{}.') or"
        " text with {prompt}",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size with --tokenizer train")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core)")
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="largest shard file, in MiB")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad files/lines instead of stopping")
    p.add_argument(
        "--tokenizer-sample-mb",
        type=float,
        default=TOKENIZER_SAMPLE_MB,
        help="with --tokenizer train: MiB of train documents it is trained on",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 on a user error, printed as one line)."""
    try:
        args = _parser().parse_args(argv)
        prepare(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            seq_len=args.seq_len,
            val_fraction=args.val_fraction,
            fmt=args.format,
            vocab_size=args.vocab_size,
            seed=args.seed,
            force=args.force,
            workers=args.workers,
            shard_mb=args.shard_mb,
            skip_bad=args.skip_bad,
            tokenizer_sample_mb=args.tokenizer_sample_mb,
            val_inputs=args.val_input,
            max_completion_length=args.max_completion_length,
            columns=parse_columns(args.columns),
            chat_template=args.chat_template,
            prompt_template=args.prompt_template,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
