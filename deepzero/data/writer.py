"""What every data format writes with: rows into shards in a temp folder published atomically, the train/val split
by hash, the tokenizer checks and reference, and the ``--skip-bad`` policy. Text and chat (:mod:`prepare`),
preference pairs (:mod:`preference`) and prompts (:mod:`prompts`) all use it; a new format plugs in here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from transformers import PreTrainedTokenizerBase

from deepzero.data.dataset import META_FILE, shard_files, shard_name
from deepzero.data.sources import Chat
from deepzero.errors import UserError

SKIPPED_LISTED = 10


def doc_prefix(tok: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids the tokenizer puts before a text's own tokens when it adds its special tokens (its post-processor,
    set by ``add_bos_token``): ``(bos,)`` for DeepSeek's, ``()`` for a tokenizer that adds none."""
    probe = "a"
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i])
    return ()


SPLIT_HASHED = "val when blake2b(key=str(seed), content) as a fraction of 2**64 < val_fraction"


SPLIT_GIVEN = "val = every document of val_inputs (--val-input), train = every document of inputs"
"""meta.json's ``split``: where the val split came from (with ``val_inputs`` and ``val_fraction`` beside it)."""


def split_of(value: str | Chat, seed: int, val_fraction: float) -> str:
    """``"val"`` when the document's hash under ``seed`` falls below ``val_fraction``, else ``"train"``."""
    digest = hashlib.blake2b(_doc_key(value), digest_size=8, key=str(seed).encode()).digest()
    return "val" if int.from_bytes(digest, "little") < val_fraction * 2**64 else "train"


def _doc_key(value: str | Chat) -> bytes:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def remove_stale_temps(out: Path) -> None:
    """Delete temp folders of earlier runs into ``out`` that were killed (their process is gone)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tokenizer_ref(spec: str, out: Path, tmp: Path) -> str:
    """What meta.json records: the absolute folder, or the hub id. A folder inside ``out`` is carried over."""
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        return spec
    if path.is_relative_to(out.resolve()):  # lives in the folder about to be replaced
        shutil.copytree(path, tmp / path.relative_to(out.resolve()))
    return str(path)


def check_tokenizer(tok: PreTrainedTokenizerBase, name: str, chat: bool) -> None:
    if chat and not getattr(tok, "chat_template", None):
        raise UserError(
            f"--tokenizer {name}",
            "has no chat_template, so chat 'messages' cannot be rendered",
            "use --tokenizer train (it has a chat template), a chat/instruct model's tokenizer, "
            "or set chat_template in its tokenizer_config.json",
        )
    if not chat and tok.eos_token_id is None:
        raise UserError(f"--tokenizer {name}", "has no eos token to separate documents", "use one with an eos_token")


class BadInput:
    """``on_bad`` for the readers: raise (default), or with ``--skip-bad`` count and list the first few."""

    def __init__(self, skip: bool) -> None:
        self.skip, self.count, self.listed = skip, 0, []

    def __call__(self, err: UserError) -> None:
        if not self.skip:
            raise err
        self.count += 1
        if len(self.listed) < SKIPPED_LISTED:
            self.listed.append(f"{err.where}: {err.problem}")


@dataclass(frozen=True)
class Layout:
    """Where and how rows are written: the folder, the row length and dtype, and rows per shard."""

    folder: Path
    row_len: int
    dtype: np.dtype
    shard_rows: int


class ShardWriter:
    """Writes one split's rows (and chat masks) into ``{split}-NNNNN.bin`` shards of ``shard_rows`` rows at most."""

    def __init__(self, layout: Layout, split: str, with_mask: bool) -> None:
        self.layout, self.split, self.with_mask = layout, split, with_mask
        self.shards: list[dict[str, Any]] = []
        self.files: tuple[BinaryIO, BinaryIO | None] | None = None

    @property
    def n_rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def write(self, rows: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append ``rows`` (``[n, row_len]``) and their mask rows."""
        lo = 0
        while lo < len(rows):
            if self.files is None or self.shards[-1]["rows"] == self.layout.shard_rows:
                self._next_shard()
            take = min(len(rows) - lo, self.layout.shard_rows - self.shards[-1]["rows"])
            tokens_fh, mask_fh = self.files
            tokens_fh.write(rows[lo : lo + take].astype(self.layout.dtype, copy=False).tobytes())
            if mask_fh is not None:
                mask_fh.write(mask[lo : lo + take].astype(np.uint8, copy=False).tobytes())
            self.shards[-1]["rows"] += take
            lo += take

    def _next_shard(self) -> None:
        self.close()
        name = shard_name(self.split, len(self.shards))
        tokens, mask = shard_files(self.layout.folder, name)
        self.files = (tokens.open("wb"), mask.open("wb") if self.with_mask else None)
        self.shards.append({"file": name, "rows": 0})

    def close(self) -> None:
        if self.files is not None:
            for fh in self.files:
                if fh is not None:
                    fh.close()
            self.files = None


def check_rows(n_rows: int, split: str, row_len: int, fix: str | None = None) -> None:
    if n_rows == 0:
        raise UserError(
            f"{split} split",
            f"holds less than one row of {row_len} tokens",
            fix or "add data, raise --val-fraction (for val), or lower --seq-len",
        )


@dataclass(frozen=True)
class Provenance:
    """What every prepared folder's meta.json records about where its rows came from and how they were split."""

    tokenizer: str
    inputs: Sequence[str]
    val_inputs: Sequence[str]
    columns: dict[str, str] | None
    val_fraction: float
    seed: int
    fingerprint: str
    started: float
    """``time.perf_counter()`` when the preparation began."""
    tokenizer_identity: dict[str, Any] | None = None
    """``deepzero.data.tokenizer.identity`` of the tokenizer the ids came from (train.py compares the model's)."""

    def meta(self, bad: BadInput) -> dict[str, Any]:
        """meta.json's provenance keys: the skipped records, the tokenizer, the inputs and the split, the
        fingerprint an up-to-date check compares, and the seconds the preparation took."""
        return {
            "skipped": {"count": bad.count, "first": bad.listed},
            "tokenizer": self.tokenizer,
            "tokenizer_identity": self.tokenizer_identity,
            "inputs": list(self.inputs),
            "val_inputs": list(self.val_inputs),
            "columns": dict(self.columns or {}),
            "val_fraction": self.val_fraction,
            "split": SPLIT_GIVEN if self.val_inputs else SPLIT_HASHED,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "seconds": round(time.perf_counter() - self.started, 2),
        }


def publish_with_meta(tmp: Path, out: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as the temp folder's meta.json, then swap the folder into place (:func:`publish`)."""
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    publish(tmp, out)


def publish(tmp: Path, out: Path) -> None:
    """Swap the finished temp folder into place (the old output, if any, is removed only afterwards)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
