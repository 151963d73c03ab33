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

import argparse
import hashlib
import itertools
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deepzero.data.chat_render import chat_renderer
from deepzero.data.dataset import MASK_START, MASK_TARGET, meta_header
from deepzero.data.packing import Progress, write_splits
from deepzero.data.prepare_checks import (
    DEFAULT_SHARD_MB,
    DEFAULT_VAL_FRACTION,
    FORMATS,
    check_args,
    check_templates,
    choose_val_fraction,
    completion_length,
    existing_meta,
    files_intact,
    prepare_fingerprint,
)
from deepzero.data.sources import Doc, Format, doc_text, input_bytes, inputs_digest, iter_docs, parse_columns
from deepzero.data.tokenize_workers import Encoder, batches
from deepzero.data.tokenizer import identity, train_tokenizer_from_texts
from deepzero.data.writer import (
    BadInput,
    Layout,
    Provenance,
    check_tokenizer,
    doc_prefix,
    publish_with_meta,
    remove_stale_temps,
    split_of,
    tokenizer_ref,
)
from deepzero.errors import UserError

TOKENIZER_SAMPLE_MB = 64


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
    val_fraction = choose_val_fraction(val_fraction, val_inputs)
    check_args(seq_len, val_fraction, fmt, workers, shard_mb)
    check_templates(fmt, chat_template, prompt_template)
    max_completion_length = completion_length(fmt, seq_len, max_completion_length)
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
    if fmt == "preference":  # 2: pairs render with chat_render.pair_template (R1 reasoning kept); older folders redo
        settings["pair_render"] = 2
    if tokenizer == "train":
        settings["tokenizer_sample_mb"] = tokenizer_sample_mb
    if val_inputs:
        settings["val_inputs"] = inputs_digest(val_inputs, "--val-input")
    fingerprint = prepare_fingerprint(inputs, tokenizer, seq_len, val_fraction, fmt, vocab_size, seed, settings)
    old = existing_meta(out)
    if old is not None and old.get("fingerprint") == fingerprint and not force and files_intact(out):
        print(f"prepare: {out} up to date ({old['n_rows']['train']} train / {old['n_rows']['val']} val rows)")
        return old
    start = time.perf_counter()
    loaded = None if tokenizer == "train" else _load_tokenizer(tokenizer)
    if fmt == "preference":
        from deepzero.data.preference import prepare_pairs

        args = (seq_len, val_fraction, vocab_size, seed, skip_bad, fingerprint)
        return prepare_pairs(
            inputs, out, loaded, tokenizer, *args, val_inputs=val_inputs, columns=columns, chat_template=chat_template
        )
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
        tasks = batches(_chain(first, docs), None if val_fraction is not None else "train")
        if val_inputs:
            tasks = itertools.chain(tasks, batches(_held_out(val_inputs, fmt, chat, bad, columns), "val"))
        check_tokenizer(tok, tokenizer, chat)
        dtype = np.dtype(np.uint16 if len(tok) < 2**16 else np.uint32)
        prefix = doc_prefix(tok)
        renderer = chat_renderer(tok, tokenizer, chat_template) if chat else None
        encoder = Encoder(tok, renderer, seed, val_fraction, dtype.name, prefix)
        layout = Layout(tmp, seq_len + 1, dtype, max(1, int(shard_mb * 2**20) // ((seq_len + 1) * dtype.itemsize)))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with Progress(total_bytes) as progress:
            stats = write_splits(tasks, encoder, workers, layout, chat, pad, progress, given_val=bool(val_inputs))
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


def _summary(meta: dict[str, Any], out: Path, progress: Progress, workers: int) -> str:
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
        help="chat and preference data: render with this template (r1-distill-training, deepseek-v3-training, or a"
        " Jinja file) instead of the tokenizer's (TRL's training variant where TRL has one); see docs/sft.md",
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
