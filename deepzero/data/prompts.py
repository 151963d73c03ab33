"""Prompts for GRPO: records with a ``prompt`` and any other fields, prepared into prompt rows, read as prompts.

    python data/prepare.py --format prompts --input gsm8k.jsonl --columns prompt=question,answer=answer \
        --tokenizer artifacts/tokenizers/deepseek --seq-len 1024 --max-completion-length 768 --out artifacts/data/gsm8k

A record's ``prompt`` is a string (tokenized as it is, after the tokenizer's own prefix: ``<bos>`` for DeepSeek's,
as TRL's ``GRPOTrainer`` tokenizes a plain prompt) or a message list (rendered with the tokenizer's chat template and
``add_generation_prompt=True``; the prefix is added unless the template wrote it). Every other field (``answer``,
``tests``, ...) is kept per record and handed to the reward functions (:mod:`deepzero.rollout.rewards`), as TRL passes the
dataset's columns. ``--seq-len`` caps prompt + completion: a prompt longer than ``max_prompt_len = seq_len -
max_completion_length`` tokens is a bad record.

On disk: rows of ``max_prompt_len`` tokens, one prompt per row, right-padded with ``pad_id``, mask bit 0 on the
prompt's tokens (shards as the other formats), and ``{split}.records.jsonl``, line ``i`` = row ``i``'s
``{"text": rendered prompt, "prompt": the record's prompt, "fields": other fields}``.

Bad records (not an object, no or an empty ``prompt``, a prompt of another type, fields that are not JSON, a prompt
too long) are one line naming the file and line, or with ``--skip-bad`` skipped and counted in meta.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from deepzero.data.dataset import PackedDataset, meta_header
from deepzero.data.preference import PairEncoder
from deepzero.data.record_shapes import is_message
from deepzero.data.sources import Chat, iter_records
from deepzero.data.tokenizer import identity, train_tokenizer_from_texts
from deepzero.data.writer import (
    BadInput,
    Layout,
    Provenance,
    ShardWriter,
    check_rows,
    doc_prefix,
    publish_with_meta,
    remove_stale_temps,
    split_of,
    tokenizer_ref,
)
from deepzero.errors import UserError

FORMAT = "prompts"
MASK_PROMPT = 1
"""Mask bit 0 of a prompt row: the prompt's own tokens (the rest of the row is padding)."""
_FIX_RECORD = (
    'write {"prompt": "..." or [{"role": ..., "content": ...}], other fields...}, or map a field with'
    " --columns prompt=FIELD"
)


PROMPT_TEMPLATES = {"r1-math": "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."}
"""``--prompt-template`` names. ``r1-math``: the instruction DeepSeek's R1 usage notes give for math (and its evaluations
use), so the answer comes boxed where math-verify's ``accuracy`` reads it."""


def template_text(template: str | None) -> str | None:
    """``--prompt-template``'s text (a :data:`PROMPT_TEMPLATES` name, or text with ``{prompt}``), or a UserError."""
    if template is None:
        return None
    text = PROMPT_TEMPLATES.get(template, template)
    if "{prompt}" not in text:
        raise UserError(
            f"--prompt-template {template}",
            "is neither a known name nor text with {prompt}",
            f"use {', '.join(PROMPT_TEMPLATES)} or e.g. '{{prompt}} Answer briefly.'",
        )
    return text


def apply_template(prompt: Prompt, text: str | None) -> Prompt:
    """``prompt`` as a user turn of the template ``text`` (:func:`template_text`): a string prompt becomes that one
    user message, a message list has its last user message rewritten."""
    if text is None:
        return prompt
    if isinstance(prompt.value, str):
        return replace(prompt, value=[{"role": "user", "content": text.replace("{prompt}", prompt.value)}])
    last = max((i for i, m in enumerate(prompt.value) if m["role"] == "user"), default=None)
    if last is None:
        return prompt
    content = text.replace("{prompt}", prompt.value[last]["content"])
    return replace(
        prompt, value=[*prompt.value[:last], {**prompt.value[last], "content": content}, *prompt.value[last + 1 :]]
    )


def records_file(split: str) -> str:
    """The file holding a split's records, next to its shards."""
    return f"{split}.records.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One record: its prompt (a string or messages), its other fields, and where it came from."""

    value: str | Chat
    fields: dict[str, Any]
    where: str

    def key(self) -> str | Chat:
        """What the train/val split hashes: the prompt."""
        return self.value


def parse_prompt(record: dict[str, Any], where: str) -> Prompt:
    """A record as a :class:`Prompt`, or a UserError naming ``where`` and what is wrong."""
    if "prompt" not in record:
        raise UserError(where, f"record has no 'prompt' (keys: {sorted(record)})", _FIX_RECORD)
    value = record["prompt"]
    if isinstance(value, list) and value and all(is_message(m) for m in value):
        value = [{"role": m["role"], "content": m["content"]} for m in value]
    elif not isinstance(value, str):
        raise UserError(where, "'prompt' is neither a string nor a non-empty list of {role, content}", _FIX_RECORD)
    elif not value.strip():
        raise UserError(where, "'prompt' is empty", "give the record a prompt, or drop it")
    fields = {k: v for k, v in record.items() if k != "prompt"}
    try:
        json.dumps(fields, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise UserError(where, f"the record's other fields are not JSON ({err})", "keep only JSON values") from None
    return Prompt(value, fields, where)


def read_prompts(
    specs: Sequence[str],
    on_bad: Any,
    columns: dict[str, str] | None = None,
    flag: str = "--input",
    template: str | None = None,
) -> Iterator[Prompt]:
    """Every record of the inputs as a :class:`Prompt` (in the template text ``template``, :func:`apply_template`); a
    bad one goes to ``on_bad`` (raise or count)."""
    for record in iter_records(specs, on_bad, columns, flag):
        try:
            yield apply_template(parse_prompt(record.fields, record.where), template)
        except UserError as err:
            on_bad(err)


class PromptEncoder(PairEncoder):
    """A prompt's rendered text and token ids, as TRL's ``GRPOTrainer`` tokenizes it (preference's renderer)."""

    def encode(self, prompt: Prompt) -> tuple[str, list[int]]:
        if isinstance(prompt.value, str):
            return prompt.value, self.tokens(prompt.value)
        if not getattr(self.tok, "chat_template", None):
            raise UserError(
                f"--tokenizer {self.name}",
                "has no chat_template, so message-list prompts cannot be rendered",
                "use a chat model's tokenizer (data/tokenizer.py deepseek), or give string prompts",
            )
        text = self.render(prompt.value, add_generation_prompt=True)
        return text, self.tokens(text)


def prepare_prompts(
    inputs: Sequence[str],
    out: Path,
    tok: PreTrainedTokenizerBase | None,
    tokenizer: str,
    seq_len: int,
    max_completion_length: int,
    val_fraction: float | None,
    vocab_size: int,
    seed: int,
    skip_bad: bool,
    fingerprint: str,
    val_inputs: Sequence[str] = (),
    columns: dict[str, str] | None = None,
    shard_mb: float = 256,
    prompt_template: str | None = None,
) -> dict[str, Any]:
    """Write ``out`` (see the module docstring) and return its meta.json contents. With ``val_inputs``
    (``--val-input``) val is their records and train every record of ``inputs``; else a prompt's hash decides."""

    start = time.perf_counter()
    template = template_text(prompt_template)  # a bad template is the flag's error, never a bad record's
    max_prompt_len = seq_len - max_completion_length
    bad = BadInput(skip_bad)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers: dict[str, Any] = {}
    records: dict[str, Any] = {}
    try:

        def prompts() -> Iterator[tuple[Prompt, str]]:
            for prompt in read_prompts(inputs, bad, columns, template=template):
                yield prompt, ("train" if val_inputs else split_of(prompt.key(), seed, val_fraction))
            for prompt in read_prompts(val_inputs, bad, columns, flag="--val-input", template=template):
                yield prompt, "val"

        if tok is None:
            texts = (_plain(pr.value) for pr, split in prompts() if split == "train")
            tok = train_tokenizer_from_texts(texts, vocab_size, tmp / "tokenizer")
            tok_ref = str(out.resolve() / "tokenizer")
            bad = BadInput(skip_bad)  # the first pass's bad records are counted in this one
        else:
            tok_ref = tokenizer_ref(tokenizer, out, tmp)
        prefix = doc_prefix(tok)
        encoder = PromptEncoder(tok, tokenizer, prefix)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        dtype = np.dtype(np.uint16 if len(tok) < 2**16 else np.uint32)
        shard_rows = max(1, int(shard_mb * 2**20) // (max_prompt_len * dtype.itemsize))
        layout = Layout(tmp, max_prompt_len, dtype, shard_rows)
        for split in ("train", "val"):
            writers[split] = ShardWriter(layout, split, with_mask=True)
            records[split] = (tmp / records_file(split)).open("w", encoding="utf-8")
        tokens = {"train": 0, "val": 0}
        fields: set[str] = set()
        held: tuple[Prompt, str, list[int]] | None = None  # the last train prompt: val's if val gets none

        def write(split: str, prompt: Prompt, text: str, ids: list[int]) -> None:
            row = np.full((1, max_prompt_len), pad, dtype=dtype)
            mask = np.zeros((1, max_prompt_len), dtype=np.uint8)
            row[0, : len(ids)], mask[0, : len(ids)] = ids, MASK_PROMPT
            writers[split].write(row, mask)
            line = {"text": text, "prompt": prompt.value, "fields": prompt.fields}
            records[split].write(json.dumps(line, ensure_ascii=False) + "\n")
            tokens[split] += len(ids)

        for prompt, split in prompts():
            try:
                text, ids = encoder.encode(prompt)
                if len(ids) > max_prompt_len:
                    raise UserError(
                        prompt.where,
                        f"the prompt is {len(ids)} tokens, longer than max_prompt_len {max_prompt_len}"
                        f" (--seq-len {seq_len} - --max-completion-length {max_completion_length})",
                        "raise --seq-len or lower --max-completion-length, shorten the prompt, or pass --skip-bad",
                    )
            except UserError as err:
                if err.where != prompt.where:
                    raise
                bad(err)
                continue
            fields.update(prompt.fields)
            if split == "train" and not val_inputs:
                if held is not None:
                    write("train", *held)
                held = (prompt, text, ids)
            else:
                write(split, prompt, text, ids)
        if held is not None:  # a tiny input: its last train prompt becomes val
            write("val" if writers["val"].n_rows == 0 and writers["train"].n_rows else "train", *held)
        for split in ("train", "val"):
            writers[split].close()
            records[split].close()
            fix = (
                "add records to --val-input"
                if val_inputs and split == "val"
                else "add records (or raise --val-fraction)"
            )
            check_rows(writers[split].n_rows, split, max_prompt_len, fix)
        n_rows = {s: w.n_rows for s, w in writers.items()}
        meta = {
            **meta_header(FORMAT, seq_len, dtype, tok),
            "max_prompt_len": max_prompt_len,
            "max_completion_length": max_completion_length,
            "pad_id": pad,
            "doc_prefix_ids": list(prefix),
            "n_docs": n_rows,
            "n_rows": n_rows,
            "n_tokens": tokens,
            "n_target_tokens": {"train": 0, "val": 0},
            "n_dropped": {"train": 0, "val": 0},
            "shards": {s: w.shards for s, w in writers.items()},
            "mask_bits": {"prompt": MASK_PROMPT},
            "rows": f"one prompt per row of max_prompt_len tokens, right-padded with pad_id; its record in"
            f" {records_file('SPLIT')} (line i = row i)",
            "record_fields": sorted(fields),
            **Provenance(
                tok_ref, inputs, val_inputs, columns, val_fraction, seed, fingerprint, start, identity(tok)
            ).meta(bad),
            "shard_mb": shard_mb,
        }
        publish_with_meta(tmp, out, meta)
    finally:
        for fh in records.values():
            fh.close()
        for w in writers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"prepare: wrote {out}: {n_rows['train']:,} train / {n_rows['val']:,} val prompts of at most {max_prompt_len}"
        f" tokens (seq_len {seq_len} - max_completion_length {max_completion_length}); record fields"
        f" {sorted(fields)}; {bad.count} bad record(s) skipped" + "".join(f"\n  skipped   {x}" for x in bad.listed)
    )
    return meta


def _plain(value: str | Chat) -> str:
    return value if isinstance(value, str) else "\n".join(m["content"] for m in value)


class PromptDataset(PackedDataset):
    """A prepared prompts split (GRPO): sample ``i`` is prompt ``i``'s ids and its index.

    ``ds[i] = {"prompt_ids": LongTensor[p] (unpadded), "index": i}``; :meth:`collate` left-pads a micro-batch with
    ``pad_id`` (``prompt_ids`` [b, P], ``prompt_mask`` [b, P] True on prompt tokens, ``index`` [b]);
    :meth:`record` is the record's other fields (for the rewards) and :meth:`prompt_text` the rendered prompt.
    """

    rows_per_sample = 1

    def __init__(self, data_dir: Path | str, split: str, documents: bool = True, vocab_size: int | None = None) -> None:
        super().__init__(data_dir, split, documents=True, vocab_size=vocab_size)  # documents: no meaning here
        if self.meta["format"] != FORMAT:
            raise UserError(str(data_dir), f"holds {self.meta['format']} data, not prompts", "prepare --format prompts")
        self.pad_id: int = self.meta["pad_id"]
        self.max_prompt_len: int = self.meta["max_prompt_len"]
        self.max_completion_length: int = self.meta["max_completion_length"]
        self.records_path = self.data_dir / records_file(split)
        self._offsets: np.ndarray | None = None

    def __getitem__(self, i: int) -> dict[str, Any]:
        tokens, mask = self.row(int(i))
        n = int(np.count_nonzero(mask & MASK_PROMPT))
        return {"prompt_ids": torch.from_numpy(tokens[:n].astype(np.int64)), "index": int(i)}

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Left-pad the prompts to the longest: ``prompt_ids`` [b, P], ``prompt_mask`` [b, P], ``index`` [b]."""
        width = max(len(item["prompt_ids"]) for item in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.bool)
        for r, item in enumerate(items):
            n = len(item["prompt_ids"])
            ids[r, width - n :], mask[r, width - n :] = item["prompt_ids"], True
        return {"prompt_ids": ids, "prompt_mask": mask, "index": torch.tensor([it["index"] for it in items])}

    def record(self, i: int) -> dict[str, Any]:
        """The record's fields other than ``prompt`` (``answer``, ``tests``, ...), as prepared."""
        return self._line(i)["fields"]

    def prompt(self, i: int) -> Any:
        """The record's prompt as given: a string, or a message list (what TRL passes a reward as ``prompts``)."""
        return self._line(i)["prompt"]

    def prompt_text(self, i: int) -> str:
        """The prompt as rendered (chat template applied), without the tokenizer's prefix."""
        return self._line(i)["text"]

    def _line(self, i: int) -> dict[str, Any]:
        if not 0 <= int(i) < self.n_rows:
            raise IndexError(f"prompt {i} out of range for {self.n_rows} prompts")
        if self._offsets is None:
            sizes = [0]
            with self.records_path.open("rb") as fh:
                sizes += [len(line) for line in fh]
            if len(sizes) != self.n_rows + 1:
                raise UserError(
                    str(self.records_path),
                    f"holds {len(sizes) - 1} records for {self.n_rows} prompt rows",
                    "re-run data/prepare.py --format prompts into this folder (--force)",
                )
            self._offsets = np.cumsum(sizes)
        lo, hi = int(self._offsets[int(i)]), int(self._offsets[int(i) + 1])
        with self.records_path.open("rb") as fh:
            fh.seek(lo)
            return json.loads(fh.read(hi - lo))
