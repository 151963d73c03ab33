"""Reading input documents lazily: text files and folders, JSONL, parquet, Hugging Face datasets, and ``stdlib``.

An input spec is one of: a path (``.txt``/``.py``/``.md`` file = one document; a folder = all such files in it;
``.jsonl`` with a ``text`` or ``messages`` field per line; ``.parquet`` with a ``text`` or ``messages`` column),
``stdlib`` (the standard library's own source, see :func:`stdlib_corpus`), or ``hf:NAME[:CONFIG][:SPLIT]`` (a dataset
streamed with ``datasets.load_dataset(..., streaming=True)``; split defaults to ``train``).

:func:`iter_docs` yields one :class:`Doc` at a time and never holds more than one file (text), one line (JSONL)
or one record batch (parquet). Bad input (an unreadable file, invalid UTF-8, a bad JSONL line or record) goes to
``on_bad`` as a :class:`UserError` naming the file and line: the default raises it, ``prepare --skip-bad`` counts it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deepzero.data.record_shapes import FIX_RECORD, Chat, Format, pick_fields, record_doc, wanted
from deepzero.data.tokenizer import stdlib_corpus
from deepzero.errors import UserError

TEXT_SUFFIXES = (".txt", ".py", ".md")
OnBad = Callable[[UserError], None]
_FIX_SPEC = "pass a .txt/.py/.md/.jsonl/.parquet file, a folder, 'stdlib', or hf:NAME[:CONFIG][:SPLIT]"
_FIX_BAD = "fix or remove it, or pass --skip-bad to skip (and count) bad input"
_PARQUET_BATCH = 1024


@dataclass(frozen=True)
class Doc:
    """One input document: plain text or a conversation, where it came from, and the input bytes it stands for."""

    value: str | Chat
    where: str
    nbytes: int


@dataclass(frozen=True)
class Corpus:
    """All documents of small inputs in memory: plain texts (``format == "text"``) or conversations (``"chat"``)."""

    docs: list[str] | list[Chat]
    format: Literal["text", "chat"]


def raise_bad(err: UserError) -> None:
    """The default ``on_bad``: stop at the first bad input."""
    raise err


HUB_SPEC = re.compile(r"hf:(?P<name>[^:]+)(?::(?P<a>[^:\[]+(?:\[[^\]]*\])?))?(?::(?P<b>[^:\[]+(?:\[[^\]]*\])?))?")
"""hf:NAME, then up to two parts; a split may carry a slice (``train[:10%]``), colon included."""
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
"""A lone part after ``hf:NAME:`` that starts with one of these is a split; anything else is a config name."""


@dataclass(frozen=True)
class HubDataset:
    """``hf:NAME``, ``hf:NAME:SPLIT``, ``hf:NAME:CONFIG`` or ``hf:NAME:CONFIG:SPLIT`` (the split defaults to train)."""

    name: str
    config: str | None
    split: str

    @classmethod
    def parse(cls, spec: str) -> HubDataset:
        match = HUB_SPEC.fullmatch(spec)
        if match is None:
            raise UserError(spec, "is not hf:NAME[:CONFIG][:SPLIT]", "e.g. hf:openai/gsm8k:main:train")
        name, rest = match["name"], [part for part in (match["a"], match["b"]) if part]
        if len(rest) == 2:
            return cls(name, rest[0], rest[1])
        if rest and not rest[0].split("[")[0].startswith(SPLIT_NAMES):
            return cls(name, rest[0], "train")
        return cls(name, None, rest[0] if rest else "train")

    def load(self) -> Any:
        """The dataset's split, streamed (``datasets.load_dataset(name, config, split=, streaming=True)``)."""
        import datasets  # slow import: only when needed

        return datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)


def input_files(spec: str, flag: str = "--input") -> list[Path]:
    """The local files behind one input spec (empty for ``hf:``); raises if a path is missing or holds nothing
    (the error names ``flag``, the option that gave the spec)."""
    if spec == "stdlib":
        return stdlib_corpus()
    if spec.startswith("hf:"):
        return []
    path = Path(spec)
    if not path.exists():
        raise UserError(f"{flag} {spec}", "no such file or folder", _FIX_SPEC)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"{flag} {spec}", f"folder holds no {'/'.join(TEXT_SUFFIXES)} files", _FIX_SPEC)
        return files
    if path.suffix not in (*TEXT_SUFFIXES, ".jsonl", ".parquet"):
        raise UserError(f"{flag} {spec}", f"unsupported file type '{path.suffix}'", _FIX_SPEC)
    return [path]


def inputs_digest(specs: Sequence[str], flag: str = "--input") -> str:
    """Hash of what the inputs are right now (specs, then each file's path, size, mtime): the part of the
    fingerprint that changes with the data. Streams over the files, so it stays small for millions of them."""
    digest = hashlib.sha256()
    for spec in specs:
        digest.update(spec.encode() + b"\0")
        for f in input_files(spec, flag):
            st = f.stat()
            digest.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def input_bytes(specs: Sequence[str]) -> int | None:
    """Total size of the input files, or None when an input's size is unknown (``hf:``)."""
    if any(s.startswith("hf:") for s in specs):
        return None
    return sum(f.stat().st_size for s in specs for f in input_files(s))


@dataclass(frozen=True)
class Record:
    """One input record as a whole (every field, ``--columns`` already applied), where it came from, its bytes."""

    fields: dict[str, Any]
    where: str
    nbytes: int


def parse_columns(spec: str | None) -> dict[str, str]:
    """``--columns prompt=question,answer=answer`` as ``{"prompt": "question", "answer": "answer"}``: the field a
    format reads (left) and the input's field that holds it (right)."""
    if not spec:
        return {}
    out: dict[str, str] = {}
    for part in spec.split(","):
        ours, eq, theirs = (x.strip() for x in part.partition("="))
        if not (eq and ours and theirs) or ours in out:
            raise UserError(
                f"--columns {spec}",
                f"'{part}' is not FIELD=INPUT_FIELD (or names {ours!r} twice)",
                "pass e.g. --columns prompt=question,answer=answer",
            )
        out[ours] = theirs
    return out


def rename(record: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """``record`` with each mapped input field under the name the format reads (``columns``: ours -> theirs);
    the mapped input fields are moved, every other field is kept as it is."""
    if not columns:
        return record
    moved = {ours: record[theirs] for ours, theirs in columns.items() if theirs in record}
    return {**{k: v for k, v in record.items() if k not in columns.values()}, **moved}


def iter_records(
    specs: Sequence[str], on_bad: OnBad = raise_bad, columns: dict[str, str] | None = None, flag: str = "--input"
) -> Iterator[Record]:
    """Every record of ``.jsonl``/``.parquet`` files and ``hf:NAME[:CONFIG][:SPLIT]`` datasets, whole, with ``columns``
    applied; a line that is not a JSON object goes to ``on_bad``. Other input kinds are refused in one line."""
    for spec in specs:
        for f in input_files(spec, flag):
            if f.suffix not in (".jsonl", ".parquet"):
                raise UserError(
                    f"{flag} {spec}", f"{f} is not .jsonl or .parquet: this format reads records", _FIX_RECORDS
                )
    for spec in specs:
        for record, where, nbytes in _raw_records(spec, on_bad):
            yield Record(rename(record, columns or {}), where, nbytes)


_FIX_RECORDS = "pass .jsonl or .parquet files, folders of them, or hf:NAME[:CONFIG][:SPLIT]"


def _raw_records(spec: str, on_bad: OnBad) -> Iterator[tuple[dict[str, Any], str, int]]:
    if spec.startswith("hf:"):
        try:
            rows = iter(HubDataset.parse(spec).load())
        except (OSError, ValueError, ConnectionError) as e:
            raise UserError(spec, f"could not load the dataset ({type(e).__name__}: {e})", _FIX_SPEC) from e
        for i, row in enumerate(rows):
            yield dict(row), f"{spec} row {i}", len(json.dumps(row, default=str))
        return
    for path in input_files(spec):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except (OSError, ValueError) as e:
                on_bad(UserError(str(path), f"cannot be read as parquet ({e})", _FIX_BAD))
                continue
            per_row = path.stat().st_size // max(1, pf.metadata.num_rows)
            row = 0
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH):
                for record in batch.to_pylist():
                    yield record, f"{path} row {row}", per_row
                    row += 1
            continue
        yield from _jsonl_records(path, on_bad)


def doc_text(value: str | Chat) -> str:
    """The text of a document (a conversation's message contents, one per line): what a tokenizer trains on."""
    return value if isinstance(value, str) else "\n".join(m["content"] for m in value)


def iter_docs(
    specs: Sequence[str],
    fmt: Format = "auto",
    on_bad: OnBad = raise_bad,
    flag: str = "--input",
    columns: dict[str, str] | None = None,
) -> Iterator[Doc]:
    """Every non-empty document of the inputs, in order. ``auto`` is decided by the first document (chat when it
    carries ``messages``); a later record of the other kind is bad input. Raises if there is no document at all.
    Errors about the inputs as a whole name ``flag`` (``--input``, or prepare's ``--val-input``). ``columns``
    (``--columns``) maps the fields read to the input's names (``{"text": "body"}``)."""
    if not specs:
        raise UserError(flag, "no inputs given", _FIX_SPEC)
    for spec in specs:  # missing paths fail before any reading
        input_files(spec, flag)
    kind: type | None = None
    for spec in specs:
        for doc in _read_spec(spec, fmt, on_bad, columns or {}):
            if not doc.value:
                continue
            if kind is None:
                kind = type(doc.value)
            elif not isinstance(doc.value, kind):
                first, this = ("text", "chat") if kind is str else ("chat", "text")
                on_bad(
                    UserError(
                        doc.where,
                        f"inputs mix plain text and chat 'messages' (this record is {this}, the first was {first})",
                        "pass --format text or chat",
                    )
                )
                continue
            yield doc
    if kind is None:
        raise UserError(f"{flag} {' '.join(specs)}", "inputs hold no non-empty documents", _FIX_SPEC)


def read_corpus(specs: Sequence[str], fmt: Format = "auto") -> Corpus:
    """Every document of the inputs in one list (small inputs only; ``prepare`` streams :func:`iter_docs`)."""
    docs = [doc.value for doc in iter_docs(specs, fmt)]
    return Corpus(docs=docs, format="text" if isinstance(docs[0], str) else "chat")  # type: ignore[arg-type]


def _read_spec(spec: str, fmt: Format, on_bad: OnBad, columns: dict[str, str]) -> Iterator[Doc]:
    if spec.startswith("hf:"):
        yield from _hf_docs(HubDataset.parse(spec), spec, fmt, on_bad, columns)
        return
    for f in input_files(spec):
        if f.suffix == ".jsonl":
            for record, where, nbytes in _jsonl_records(f, on_bad):
                try:
                    yield Doc(record_doc(rename(record, columns), where, fmt), where, nbytes)
                except UserError as e:
                    on_bad(e)
        elif f.suffix == ".parquet":
            yield from _parquet_docs(f, fmt, on_bad, columns)
        elif fmt not in ("auto", "text"):
            raise UserError(str(f), "a plain text file cannot be a chat", "use JSONL with a 'messages' field per line")
        else:
            text = _read_text(f, strict=spec != "stdlib", on_bad=on_bad)
            if text is not None:
                yield Doc(text, str(f), f.stat().st_size)


def _read_text(path: Path, strict: bool, on_bad: OnBad) -> str | None:
    """A whole text file, or None after reporting it to ``on_bad`` (unreadable, or not UTF-8 when ``strict``)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        on_bad(UserError(str(path), f"cannot be read ({e.strerror or type(e).__name__})", _FIX_BAD))
        return None
    try:
        return data.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        on_bad(UserError(f"{path}:{line}", f"line {line} is not UTF-8 text ({e.reason} at byte {e.start})", _FIX_BAD))
        return None


def _jsonl_records(path: Path, on_bad: OnBad) -> Iterator[tuple[dict[str, Any], str, int]]:
    """Each non-blank line of a JSONL file as ``(record, "path:line", bytes)``; a line that is not UTF-8, not JSON
    or not an object goes to ``on_bad``."""
    try:
        fh = path.open("rb")
    except OSError as e:
        on_bad(UserError(str(path), f"cannot be read ({e.strerror or type(e).__name__})", _FIX_BAD))
        return
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                on_bad(UserError(where, f"line {lineno} is not UTF-8 text ({e.reason} at byte {e.start})", _FIX_BAD))
                continue
            except json.JSONDecodeError as e:
                on_bad(UserError(where, f"line {lineno} is not valid JSON ({e.msg})", "fix or remove the line"))
                continue
            if not isinstance(record, dict):
                on_bad(UserError(where, f"line {lineno} is not a JSON object", 'write one {"text": ...} per line'))
                continue
            yield record, where, len(raw)


def _parquet_docs(path: Path, fmt: Format, on_bad: OnBad, columns: dict[str, str]) -> Iterator[Doc]:
    """Rows of the ``text``/``messages`` (or ``prompt`` and ``completion``) columns, one record batch in memory at
    a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        on_bad(UserError(str(path), f"cannot be read as parquet ({e})", _FIX_BAD))
        return
    names = set(pf.schema_arrow.names)
    fields = pick_fields(set(rename(dict.fromkeys(names), columns)), fmt)
    if fields is None:
        raise UserError(str(path), f"has no {wanted(fmt, 'column')} (columns: {sorted(names)})", FIX_RECORD)
    per_row = path.stat().st_size // max(1, pf.metadata.num_rows)
    row = 0
    for batch in pf.iter_batches(columns=[columns.get(f, f) for f in fields], batch_size=_PARQUET_BATCH):
        for record in batch.to_pylist():
            where = f"{path} row {row}"
            row += 1
            try:
                yield Doc(record_doc(rename(record, columns), where, fmt), where, per_row)
            except UserError as e:
                on_bad(e)


def _hf_docs(hub: HubDataset, where: str, fmt: Format, on_bad: OnBad, columns: dict[str, str]) -> Iterator[Doc]:
    """A Hugging Face dataset in streaming mode: rows arrive as they are read, nothing is cached whole."""
    try:
        rows = iter(hub.load())
        first = next(rows, None)
    except (OSError, ValueError, ConnectionError) as e:
        raise UserError(where, f"could not load the dataset ({type(e).__name__}: {e})", _FIX_SPEC) from e
    if first is None:
        return
    fields = pick_fields(set(rename(first, columns)), fmt)
    if fields is None:
        raise UserError(where, f"has no {wanted(fmt, 'column')} (columns: {sorted(first)})", FIX_RECORD)
    for i, record in enumerate(_chain_first(first, rows)):
        row_where = f"{where} row {i}"
        try:
            renamed = rename(record, columns)
            value = record_doc({f: renamed.get(f) for f in fields}, row_where, fmt)
        except UserError as e:
            on_bad(e)
            continue
        yield Doc(value, row_where, len(doc_text(value).encode("utf-8", "surrogatepass")))


def _chain_first(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
