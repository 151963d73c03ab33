"""A prepare run's arguments checked, and its fingerprint: what tells whether an earlier output is up to date."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepzero.data.dataset import FORMAT_VERSION, META_FILE, load_meta
from deepzero.data.sources import inputs_digest
from deepzero.errors import UserError

DEFAULT_SHARD_MB = 256
DEFAULT_VAL_FRACTION = 0.02
FORMATS = ("auto", "text", "chat", "alpaca", "sharegpt", "preference", "prompts")
_TOKENIZER_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model", ".tiktoken"})
_DOC_LAYOUT = "tokenizer prefix + ids + eos"
"""What a text document becomes; part of the fingerprint, so data prepared before the prefix is rebuilt."""


def choose_val_fraction(val_fraction: float | None, val_inputs: Sequence[str]) -> float | None:
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


def completion_length(fmt: str, seq_len: int, max_completion_length: int | None) -> int | None:
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


def check_args(seq_len: int, val_fraction: float | None, fmt: str, workers: int, shard_mb: float) -> None:
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


def check_templates(fmt: str, chat_template: str | None, prompt_template: str | None) -> None:
    """Each template flag belongs to one kind of data: given with another, it would be ignored."""
    if prompt_template is not None and fmt != "prompts":
        raise UserError("--prompt-template", f"applies to --format prompts, not {fmt}", "drop it, or prepare prompts")
    if chat_template is not None and fmt in ("text", "prompts"):
        raise UserError("--chat-template", f"applies to chat and preference data, not --format {fmt}", "drop it")


def prepare_fingerprint(
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


def existing_meta(out: Path) -> dict[str, Any] | None:
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


def files_intact(out: Path) -> bool:
    try:
        load_meta(out)
    except UserError:
        return False
    return True
