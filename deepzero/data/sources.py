"""Reading input documents: text files and folders, JSONL, parquet, Hugging Face datasets, and ``stdlib``.

An input spec is one of: a path (``.txt``/``.py``/``.md`` file = one document; a folder = all such files in it;
``.jsonl`` with a ``text`` or ``messages`` field per line; ``.parquet`` with a ``text`` or ``messages`` column),
``stdlib`` (the standard library's own source, see :func:`stdlib_corpus`), or ``hf:NAME[:split]`` (a dataset
loaded with ``datasets.load_dataset``; split defaults to ``train``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deepzero.data.tokenizer import stdlib_corpus
from deepzero.errors import UserError

TEXT_SUFFIXES = (".txt", ".py", ".md")
Chat = list[dict[str, str]]
Format = Literal["auto", "text", "chat"]
_FIX_SPEC = "pass a .txt/.py/.md/.jsonl/.parquet file, a folder, 'stdlib', or hf:NAME[:split]"
_FIX_RECORD = 'give each record "text": "..." or "messages": [{"role": ..., "content": ...}, ...]'


@dataclass(frozen=True)
class Corpus:
    """All documents of a run: plain texts (``format == "text"``) or conversations (``format == "chat"``)."""

    docs: list[str] | list[Chat]
    format: Literal["text", "chat"]


def input_files(spec: str) -> list[Path]:
    """The local files behind one input spec (empty for ``hf:``); raises if a path is missing or holds nothing."""
    if spec == "stdlib":
        return stdlib_corpus()
    if spec.startswith("hf:"):
        return []
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--input {spec}", "no such file or folder", _FIX_SPEC)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"--input {spec}", f"folder holds no {'/'.join(TEXT_SUFFIXES)} files", _FIX_SPEC)
        return files
    if path.suffix not in (*TEXT_SUFFIXES, ".jsonl", ".parquet"):
        raise UserError(f"--input {spec}", f"unsupported file type '{path.suffix}'", _FIX_SPEC)
    return [path]


def describe_inputs(specs: Sequence[str]) -> list[dict[str, Any]]:
    """What the inputs are right now (paths, sizes, mtimes): the part of the fingerprint that changes with the data."""
    return [
        {"spec": s, "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in input_files(s)]}
        for s in specs
    ]


def read_corpus(specs: Sequence[str], fmt: Format = "auto") -> Corpus:
    """Read every input spec into one corpus; ``auto`` picks chat when records carry ``messages``."""
    if not specs:
        raise UserError("--input", "no inputs given", _FIX_SPEC)
    docs = [doc for spec in specs for doc in _read_spec(spec, fmt) if doc]
    if not docs:
        raise UserError(f"--input {' '.join(specs)}", "inputs hold no non-empty documents", _FIX_SPEC)
    kinds = {isinstance(d, str) for d in docs}
    if len(kinds) > 1:
        raise UserError(
            f"--input {' '.join(specs)}", "inputs mix plain text and chat 'messages'", "pass --format text or chat"
        )
    return Corpus(docs=docs, format="text" if kinds == {True} else "chat")


def _read_spec(spec: str, fmt: Format) -> Iterator[str | Chat]:
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        yield from _dataset_docs(_load_hf(name, split or "train", spec), spec, fmt)
        return
    for f in input_files(spec):
        if f.suffix == ".jsonl":
            yield from _jsonl_docs(f, fmt)
        elif f.suffix == ".parquet":
            yield from _dataset_docs(_load_hf("parquet", "train", str(f), data_files=str(f)), str(f), fmt)
        elif fmt == "chat":
            raise UserError(str(f), "a plain text file cannot be a chat", "use JSONL with a 'messages' field per line")
        else:
            yield _read_text(f, strict=spec != "stdlib")


def _read_text(path: Path, strict: bool) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as e:
        raise UserError(str(path), f"not UTF-8 text ({e.reason} at byte {e.start})", "convert it to UTF-8") from e


def _load_hf(name: str, split: str, where: str, **kwargs: Any) -> Any:
    import datasets  # slow import: only when needed

    try:
        return datasets.load_dataset(name, split=split, **kwargs)
    except (OSError, ValueError, ConnectionError) as e:
        raise UserError(where, f"could not load the dataset ({type(e).__name__}: {e})", _FIX_SPEC) from e


def _jsonl_docs(path: Path, fmt: Format) -> Iterator[str | Chat]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(where, f"line {lineno} is not valid JSON ({e.msg})", "fix or remove the line") from e
            if not isinstance(record, dict):
                raise UserError(where, f"line {lineno} is not a JSON object", 'write one {"text": ...} per line')
            yield _record_doc(record, where, fmt)


def _dataset_docs(ds: Any, where: str, fmt: Format) -> Iterator[str | Chat]:
    columns = set(ds.column_names)
    field = _pick_field(columns, fmt)
    if field is None:
        raise UserError(where, f"has no 'text' or 'messages' column (columns: {sorted(columns)})", _FIX_RECORD)
    for i, value in enumerate(ds[field]):
        yield _record_doc({field: value}, f"{where} row {i}", fmt)


def _pick_field(keys: set[str], fmt: Format) -> str | None:
    order = {"auto": ("messages", "text"), "text": ("text",), "chat": ("messages",)}[fmt]
    return next((k for k in order if k in keys), None)


def _record_doc(record: dict[str, Any], where: str, fmt: Format) -> str | Chat:
    field = _pick_field(set(record), fmt)
    wanted = {"auto": "'text' or 'messages'", "text": "'text'", "chat": "'messages'"}[fmt]
    if field is None:
        raise UserError(where, f"record has no {wanted} field (keys: {sorted(record)})", _FIX_RECORD)
    value = record[field]
    if field == "text":
        if not isinstance(value, str):
            raise UserError(where, f"'text' is {type(value).__name__}, not a string", _FIX_RECORD)
        return value
    if not isinstance(value, list) or not value or not all(_is_message(m) for m in value):
        raise UserError(where, "'messages' is not a non-empty list of {role, content} strings", _FIX_RECORD)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
