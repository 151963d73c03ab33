"""Tokenize documents and pack them into fixed-length rows on disk; idempotent, prints what it did.

    python -m deepzero.data.prepare --input stdlib --tokenizer train --seq-len 256 --out artifacts/data/stdlib

Plain text: every document is tokenized, gets ``<eos>`` appended, and the stream is cut into rows of ``seq_len + 1``
tokens (the trailing remainder is dropped). Chat (``messages`` JSONL): each conversation is rendered with the
tokenizer's chat template, only assistant turns (their text and closing token) are marked as targets, and
conversations are packed whole into rows (one longer than a row is truncated), the rest of a row being padding.
Documents are split into train/val before tokenizing, deterministically by ``--seed``. See
:mod:`deepzero.data.dataset` for the on-disk format.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deepzero.data.dataset import META_FILE, load_meta, split_files
from deepzero.data.sources import Chat, Format, describe_inputs, read_corpus
from deepzero.data.tokenizer import train_tokenizer_from_texts
from deepzero.errors import UserError

FORMAT_VERSION = 1
BATCH_DOCS = 256
_TOKENIZER_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model", ".tiktoken"})


@dataclass
class SplitStats:
    """What one split became."""

    n_docs: int = 0
    n_rows: int = 0
    n_tokens: int = 0
    """Tokens stored in rows, padding excluded."""
    n_target_tokens: int = 0
    """Tokens that are training targets."""
    n_dropped: int = 0
    """Text: tail tokens that did not fill a row. Chat: conversations truncated to one row."""


def prepare(
    inputs: Sequence[str],
    out: Path | str,
    tokenizer: str = "train",
    seq_len: int = 256,
    val_fraction: float = 0.02,
    fmt: Format = "auto",
    vocab_size: int = 4096,
    seed: int = 0,
    force: bool = False,
) -> dict[str, Any]:
    """Build ``out`` (see module docstring) unless it is already up to date; return its ``meta.json`` contents."""
    out = Path(out)
    _check_args(seq_len, val_fraction, fmt)
    fingerprint = _fingerprint(inputs, tokenizer, seq_len, val_fraction, fmt, vocab_size, seed)
    old = _existing_meta(out)
    if old is not None and old.get("fingerprint") == fingerprint and not force and _files_intact(out):
        print(f"prepare: {out} up to date ({old['n_rows']['train']} train / {old['n_rows']['val']} val rows)")
        return old
    start = time.perf_counter()
    loaded = None if tokenizer == "train" else _load_tokenizer(tokenizer)
    corpus = read_corpus(inputs, fmt)
    docs = split_docs(corpus.docs, val_fraction, seed)
    print(f"prepare: {len(corpus.docs)} {corpus.format} documents: {len(docs['train'])} train, {len(docs['val'])} val")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if loaded is None:
            tok, tok_ref = _train_tokenizer(docs["train"], vocab_size, out, tmp)
        else:
            tok, tok_ref = loaded, _tokenizer_ref(tokenizer, out, tmp)
        dtype = np.dtype(np.uint16 if len(tok) < 2**16 else np.uint32)
        write = _write_chat if corpus.format == "chat" else _write_text
        stats = {split: write(part, tok, tokenizer, tmp, split, seq_len + 1, dtype) for split, part in docs.items()}
        meta = {
            "format_version": FORMAT_VERSION,
            "format": corpus.format,
            "seq_len": seq_len,
            "dtype": dtype.name,
            "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "n_docs": {s: v.n_docs for s, v in stats.items()},
            "n_rows": {s: v.n_rows for s, v in stats.items()},
            "n_tokens": {s: v.n_tokens for s, v in stats.items()},
            "n_target_tokens": {s: v.n_target_tokens for s, v in stats.items()},
            "tokenizer": tok_ref,
            "inputs": list(inputs),
            "val_fraction": val_fraction,
            "seed": seed,
            "fingerprint": fingerprint,
            "seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepare: wrote {out} in {meta['seconds']:.1f} s")
    return meta


def split_docs(docs: list[Any], val_fraction: float, seed: int) -> dict[str, list[Any]]:
    """Document-level train/val split: ``round(n * val_fraction)`` (at least 1) documents chosen by ``seed``."""
    n = len(docs)
    if n < 2:
        raise UserError("--input", f"only {n} document, cannot split train/val by document", "pass more documents")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    val = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    return {
        "train": [d for i, d in enumerate(docs) if i not in val],
        "val": [d for i, d in enumerate(docs) if i in val],
    }


def _check_args(seq_len: int, val_fraction: float, fmt: str) -> None:
    if seq_len < 1:
        raise UserError("--seq-len", f"must be positive, got {seq_len}", "pass e.g. --seq-len 256")
    if not 0 < val_fraction < 1:
        raise UserError("--val-fraction", f"must be between 0 and 1, got {val_fraction}", "pass e.g. 0.02")
    if fmt not in ("auto", "text", "chat"):
        raise UserError("--format", f"unknown format '{fmt}'", "use auto, text or chat")


def _fingerprint(
    inputs: Sequence[str], tokenizer: str, seq_len: int, val_fraction: float, fmt: str, vocab_size: int, seed: int
) -> str:
    """Hash of everything the output depends on: inputs (paths, sizes, mtimes), tokenizer, and the settings."""
    blob = {
        "version": FORMAT_VERSION,
        "inputs": describe_inputs(inputs),
        "tokenizer": _tokenizer_fingerprint(tokenizer, vocab_size),
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "format": fmt,
        "seed": seed,
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
    train_docs: list[Any], vocab_size: int, out: Path, tmp: Path
) -> tuple[PreTrainedTokenizerBase, str]:
    """Train on the train split (message contents for chat) into ``<out>/tokenizer``; return it and that path."""
    texts = (d if isinstance(d, str) else "\n".join(m["content"] for m in d) for d in train_docs)
    tok = train_tokenizer_from_texts(texts, vocab_size, tmp / "tokenizer")
    ref = str(out.resolve() / "tokenizer")
    print(f"prepare: trained a byte-level BPE tokenizer, vocab {len(tok)} -> {ref}")
    return tok, ref


def _tokenizer_ref(spec: str, out: Path, tmp: Path) -> str:
    """What meta.json records: the absolute folder, or the hub id. A folder inside ``out`` is carried over."""
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        return spec
    if path.is_relative_to(out.resolve()):  # lives in the folder about to be replaced
        shutil.copytree(path, tmp / path.relative_to(out.resolve()))
    return str(path)


def _encode(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _write_text(
    docs: list[str], tok: PreTrainedTokenizerBase, name: str, tmp: Path, split: str, row_len: int, dtype: np.dtype
) -> SplitStats:
    """Tokenize, append eos, concatenate and cut into rows (written as a flat stream, then trimmed to whole rows)."""
    eos = tok.eos_token_id
    if eos is None:
        raise UserError(f"--tokenizer {name}", "has no eos token to separate documents", "use one with an eos_token")
    path = split_files(tmp, split)[0]
    n_tokens = 0
    with path.open("wb") as fh, tqdm(total=len(docs), desc=f"tokenize {split}", unit="doc") as bar:
        for lo in range(0, len(docs), BATCH_DOCS):
            chunk = docs[lo : lo + BATCH_DOCS]
            ids = np.array([t for doc in _encode(tok, chunk) for t in [*doc, eos]], dtype=dtype)
            fh.write(ids.tobytes())
            n_tokens += ids.size
            bar.update(len(chunk))
        n_rows = n_tokens // row_len
        fh.truncate(n_rows * row_len * dtype.itemsize)
    _check_rows(n_rows, split, row_len)
    kept = n_rows * row_len
    stats = SplitStats(len(docs), n_rows, kept, n_rows * (row_len - 1), n_tokens - kept)
    print(
        f"prepare: {split}: {stats.n_tokens:,} tokens -> {n_rows:,} rows x {row_len} {dtype.name} "
        f"({stats.n_dropped:,} tail tokens dropped)"
    )
    return stats


def _write_chat(
    docs: list[Chat], tok: PreTrainedTokenizerBase, name: str, tmp: Path, split: str, row_len: int, dtype: np.dtype
) -> SplitStats:
    """Render, mask all but assistant turns, and pack whole conversations into padded rows."""
    if not getattr(tok, "chat_template", None):
        raise UserError(
            f"--tokenizer {name}",
            "has no chat_template, so chat 'messages' cannot be rendered",
            "use --tokenizer train (it has a chat template), a chat/instruct model's tokenizer, "
            "or set chat_template in its tokenizer_config.json",
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tokens_path, mask_path = split_files(tmp, split)
    stats = SplitStats(n_docs=len(docs))
    with (
        tokens_path.open("wb") as tf,
        mask_path.open("wb") as mf,
        tqdm(total=len(docs), desc=f"tokenize {split}") as bar,
    ):
        packer = _RowPacker(tf, mf, row_len, dtype, pad)
        for lo in range(0, len(docs), BATCH_DOCS):
            chunk = docs[lo : lo + BATCH_DOCS]
            for ids, mask in _encode_chats(tok, name, chunk):
                stats.n_dropped += len(ids) > row_len
                packer.add(ids[:row_len], mask[:row_len])
            bar.update(len(chunk))
        packer.flush()
    _check_rows(packer.n_rows, split, row_len)
    stats.n_rows, stats.n_tokens, stats.n_target_tokens = packer.n_rows, packer.n_tokens, packer.n_targets
    print(
        f"prepare: {split}: {stats.n_tokens:,} tokens ({stats.n_target_tokens:,} assistant targets) -> "
        f"{stats.n_rows:,} rows x {row_len} {dtype.name} ({stats.n_dropped} conversations truncated)"
    )
    return stats


def _encode_chats(tok: PreTrainedTokenizerBase, name: str, chats: list[Chat]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and a 0/1 target mask per conversation: 1 on tokens that start inside an assistant turn."""
    rendered = [_assistant_spans(tok, name, chat) for chat in chats]
    encodings = tok.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for enc, (_, spans) in zip(encodings, rendered, strict=True):
        starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=np.uint8)
        for lo, hi in spans:
            mask[(starts >= lo) & (starts < hi)] = 1
        out.append((np.array(enc.ids, dtype=np.int64), mask))
    return out


def _assistant_spans(tok: PreTrainedTokenizerBase, name: str, chat: Chat) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Turn ``i`` spans from the end of ``render(chat[:i], add_generation_prompt=True)`` to the end of
    ``render(chat[: i + 1])``, which needs a template whose renderings of prefixes are prefixes of each other.
    """

    def render(messages: Chat, add_generation_prompt: bool = False) -> str:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    full = render(chat)
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before, through = render(chat[:i], add_generation_prompt=True), render(chat[: i + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise UserError(
                f"--tokenizer {name}",
                "its chat template renders a conversation's prefix differently from the whole, "
                "so assistant turns cannot be located",
                "use --tokenizer train or a tokenizer whose chat template only appends turns",
            )
        spans.append((len(before), len(through)))
    return full, spans


class _RowPacker:
    """Packs whole conversations into fixed-length rows; a row is padded (mask 0) when the next does not fit."""

    def __init__(self, tokens: BinaryIO, mask: BinaryIO, row_len: int, dtype: np.dtype, pad: int) -> None:
        self.tokens_file, self.mask_file, self.row_len, self.dtype, self.pad = tokens, mask, row_len, dtype, pad
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.used = self.n_rows = self.n_tokens = self.n_targets = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self.used + len(ids) > self.row_len:
            self.flush()
        self.ids.append(ids)
        self.masks.append(mask)
        self.used += len(ids)
        self.n_tokens += len(ids)
        self.n_targets += int(mask.sum())

    def flush(self) -> None:
        if not self.used:
            return
        fill = self.row_len - self.used
        row = np.concatenate([*self.ids, np.full(fill, self.pad)]).astype(self.dtype)
        self.tokens_file.write(row.tobytes())
        self.mask_file.write(np.concatenate([*self.masks, np.zeros(fill, np.uint8)]).astype(np.uint8).tobytes())
        self.ids, self.masks, self.used = [], [], 0
        self.n_rows += 1


def _check_rows(n_rows: int, split: str, row_len: int) -> None:
    if n_rows == 0:
        raise UserError(
            f"{split} split",
            f"holds less than one row of {row_len} tokens",
            "add data, raise --val-fraction (for val), or lower --seq-len",
        )


def _publish(tmp: Path, out: Path) -> None:
    """Swap the finished temp folder into place (the old output, if any, is removed only afterwards)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepzero.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", default=["stdlib"], help="paths, 'stdlib', or hf:NAME[:split]")
    p.add_argument("--tokenizer", default="train", help="saved tokenizer folder, hub id, or 'train'")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sample (rows hold seq_len + 1)")
    p.add_argument("--out", default="artifacts/data/stdlib", help="output folder")
    p.add_argument("--val-fraction", type=float, default=0.02, help="fraction of documents held out")
    p.add_argument("--format", default="auto", choices=["auto", "text", "chat"], help="plain text or chat SFT")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size with --tokenizer train")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (2 on a user error, printed as one line)."""
    args = _parser().parse_args(argv)
    try:
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
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
