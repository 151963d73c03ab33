"""Preference pairs: JSONL in TRL's two standard layouts, prepared into rows in pairs, read as pairs.

    python data/prepare.py --format preference --input pairs.jsonl --tokenizer artifacts/tokenizers/deepseek \
        --seq-len 256 --out artifacts/data/dpo

A record is ``{"prompt", "chosen", "rejected"}`` with strings (the prompt becomes a user turn and each answer an
assistant turn) or with message lists, or only ``{"chosen", "rejected"}`` message lists whose shared first messages
are the prompt (TRL's implicit prompt). Both are rendered with the tokenizer's chat template as TRL's
``DPOTrainer`` renders them: the prompt with ``add_generation_prompt=True``, prompt + answer as a whole, and the
answer's tokens are those after the longest common prefix of the two. Only those are targets (mask bit 0), as in
chat SFT. Each pair is two rows of ``seq_len + 1`` tokens, chosen then rejected, each padded on the right: a
split's row ``2i`` is pair ``i``'s chosen answer, row ``2i + 1`` its rejected one (shards hold whole pairs).

Bad records (not an object, a missing or empty field, chosen equal to rejected, a pair longer than a row) are one
line naming the file and line, or with ``--skip-bad`` skipped and counted in meta.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jinja2.exceptions import TemplateError
from torch.utils.data import default_collate
from transformers import PreTrainedTokenizerBase

from deepzero.data.chat_render import PairTemplate, pair_template, refused
from deepzero.data.dataset import MASK_START, MASK_TARGET, PackedDataset, meta_header
from deepzero.data.sources import Chat, input_files, iter_records
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

FORMAT = "preference"
_FIX_RECORD = (
    'write {"prompt": ..., "chosen": ..., "rejected": ...} with strings, or message lists'
    ' [{"role": ..., "content": ...}] (then "prompt" may be left out)'
)
_FIX_BAD = "fix or remove the line, or pass --skip-bad to skip (and count) bad records"


@dataclass(frozen=True)
class Pair:
    """One preference record as conversations: the prompt's messages and each answer's messages."""

    prompt: Chat
    chosen: Chat
    rejected: Chat
    where: str

    def key(self) -> str:
        """What the train/val split hashes."""
        return json.dumps([self.prompt, self.chosen, self.rejected], sort_keys=True, ensure_ascii=False)

    def text(self) -> str:
        """Every message's text, one per line (what ``--tokenizer train`` trains on)."""
        return "\n".join(m["content"] for m in (*self.prompt, *self.chosen, *self.rejected))


def read_pairs(specs: Sequence[str], on_bad: Any, columns: dict[str, str] | None = None) -> Iterator[Pair]:
    """Every record of the JSONL inputs as a :class:`Pair` (``columns``: ``--columns``, the input's names of
    prompt/chosen/rejected); a bad one goes to ``on_bad`` (raise or count)."""
    for spec in specs:
        for path in input_files(spec):
            if path.suffix != ".jsonl":
                raise UserError(f"--input {spec}", "preference data is read from .jsonl files only", _FIX_RECORD)
    for record in iter_records(specs, on_bad, columns):
        try:
            yield parse_record(record.fields, record.where)
        except UserError as err:
            on_bad(err)


def parse_record(record: Any, where: str) -> Pair:
    """A record in either layout as a :class:`Pair`, or a UserError naming ``where`` and what is wrong."""
    if not isinstance(record, dict):
        raise UserError(where, "record is not a JSON object", _FIX_RECORD)
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise UserError(
            where, f"record has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(record)})", _FIX_RECORD
        )
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" in record:
        prompt = _turns(record["prompt"], "user", "prompt", where)
        chosen, rejected = (_turns(v, "assistant", k, where) for k, v in (("chosen", chosen), ("rejected", rejected)))
    else:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise UserError(where, "record has no 'prompt' and its answers are not message lists", _FIX_RECORD)
        chosen, rejected = (
            _turns(chosen, "assistant", "chosen", where),
            _turns(rejected, "assistant", "rejected", where),
        )
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not turns or not any(m["content"].strip() for m in turns):
            raise UserError(where, f"the {name} answer is empty", "give both answers some text, or drop the record")
    if chosen == rejected:
        raise UserError(where, "chosen and rejected are the same answer", "drop the record: it prefers nothing")
    return Pair(prompt, chosen, rejected, where)


def _turns(value: Any, role: str, name: str, where: str) -> Chat:
    """A string as one ``role`` message, or a list of {role, content} strings as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise UserError(where, f"'{name}' is neither a string nor a list of {{role, content}} strings", _FIX_RECORD)


class PairEncoder:
    """Token ids and target masks of a pair's two sequences, as TRL's ``DPOTrainer`` tokenizes conversations (with
    ``template``'s choice of chat template: an R1-Distill tokenizer's training variant keeps the reasoning)."""

    def __init__(
        self, tok: PreTrainedTokenizerBase, name: str, prefix: tuple[int, ...], template: PairTemplate | None = None
    ) -> None:
        self.tok, self.name, self.prefix = tok, name, prefix
        self.template = template or PairTemplate(None, "the tokenizer's own", False)

    def ids(self, messages: Chat, add_generation_prompt: bool = False) -> list[int]:
        """The rendered conversation's ids, the tokenizer's prefix first unless the template wrote it."""
        return self.tokens(self.render(messages, add_generation_prompt))

    def render(self, messages: Chat, add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template writes it; a template's refusal is one line naming the tokenizer."""
        try:
            return self.tok.apply_chat_template(
                messages,
                chat_template=self.template.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as err:
            raise refused(self.name, err) from None

    def tokens(self, text: str) -> list[int]:
        """``text``'s ids after the tokenizer's prefix (not doubled when the text already starts with it)."""
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.prefix and tuple(ids[: len(self.prefix)]) != self.prefix:
            ids = [*self.prefix, *ids]
        return ids

    def encode(self, pair: Pair) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``(ids, mask)`` of prompt + chosen and of prompt + rejected: mask bit 0 on the answer's tokens (those after
        the prompt's longest common prefix with both), bit 1 on the first token."""
        context = self.template.prompt_view(pair.prompt)
        prompt = self.ids(context, add_generation_prompt=True) if context else list(self.prefix)
        sequences = []
        for answer in (pair.chosen, pair.rejected):
            text = self.render(context + answer)
            self.template.check_answer(answer, text, pair.where)
            sequences.append(self.tokens(text))
        start = min(_common_prefix(prompt, seq) for seq in sequences)
        out = []
        for seq in sequences:
            mask = np.zeros(len(seq), dtype=np.uint8)
            mask[start:] = MASK_TARGET
            mask[0] |= MASK_START
            out.append((np.array(seq, dtype=np.int64), mask))
        return out[0], out[1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prepare_pairs(
    inputs: Sequence[str],
    out: Path,
    tok: PreTrainedTokenizerBase | None,
    tokenizer: str,
    seq_len: int,
    val_fraction: float,
    vocab_size: int,
    seed: int,
    skip_bad: bool,
    fingerprint: str,
    val_inputs: Sequence[str] = (),
    columns: dict[str, str] | None = None,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """Write ``out`` (rows in pairs, see the module docstring) and return its meta.json contents. With ``val_inputs``
    (``--val-input``) val is their pairs and train every pair of ``inputs``; else a pair's hash decides.
    ``chat_template`` (``--chat-template``): a named template or a file, else :func:`pair_template`'s choice."""

    start = time.perf_counter()
    bad = BadInput(skip_bad)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        given = "train" if val_inputs else None
        pairs = [(pair, given) for pair in read_pairs(inputs, bad, columns)]
        pairs += [(pair, "val") for pair in read_pairs(val_inputs, bad, columns)]
        if len(pairs) < 2:
            raise UserError(
                f"--input {' '.join(inputs)}", f"holds {len(pairs)} usable pair(s)", "pass at least two pairs"
            )
        if tok is None:
            texts = (pair.text() for pair, to in pairs if (to or split_of(pair.key(), seed, val_fraction)) == "train")
            tok = train_tokenizer_from_texts(texts, vocab_size, tmp / "tokenizer")
            tok_ref = str(out.resolve() / "tokenizer")
        else:
            tok_ref = tokenizer_ref(tokenizer, out, tmp)
        check_tokenizer(tok, tokenizer, chat=True)
        template = pair_template(tok, chat_template)
        encoder = PairEncoder(tok, tokenizer, doc_prefix(tok), template)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        row_len = seq_len + 1
        rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
        tokens = {"train": 0, "val": 0}
        targets = {"train": 0, "val": 0}
        for pair, to in pairs:
            try:
                encoded = encoder.encode(pair)
                longest = max(len(ids) for ids, _ in encoded)
                if longest > row_len:
                    raise UserError(
                        pair.where,
                        f"the pair is {longest} tokens with its prompt, a row holds {row_len} (--seq-len {seq_len} + 1)",
                        f"prepare with --seq-len {longest - 1} or more, shorten the record, or pass --skip-bad",
                    )
            except UserError as err:
                if err.where != pair.where:
                    raise
                bad(err)
                continue
            split = to or split_of(pair.key(), seed, val_fraction)
            rows[split].extend(encoded)
            tokens[split] += sum(len(ids) for ids, _ in encoded)
            targets[split] += sum(int((mask & MASK_TARGET).sum()) for _, mask in encoded)
        if (
            not rows["val"] and len(rows["train"]) >= 4 and not val_inputs
        ):  # a tiny input: its last train pair becomes val
            rows["val"] = rows["train"][-2:]
            del rows["train"][-2:]
        dtype = np.dtype(np.uint16 if len(tok) < 2**16 else np.uint32)
        shards = {}
        for split, seqs in rows.items():
            check_rows(len(seqs), split, row_len)
            ids = np.full((len(seqs), row_len), pad, dtype=dtype)
            mask = np.zeros((len(seqs), row_len), dtype=np.uint8)
            for i, (seq, bits) in enumerate(seqs):
                ids[i, : len(seq)], mask[i, : len(bits)] = seq, bits
            writer = ShardWriter(Layout(tmp, row_len, dtype, len(seqs)), split, with_mask=True)
            writer.write(ids, mask)
            writer.close()
            shards[split] = writer.shards
        n_pairs = {s: len(v) // 2 for s, v in rows.items()}
        meta = {
            **meta_header(FORMAT, seq_len, dtype, tok),
            "n_pairs": n_pairs,
            "n_docs": {s: 2 * n for s, n in n_pairs.items()},
            "n_rows": {s: len(v) for s, v in rows.items()},
            "n_tokens": tokens,
            "n_target_tokens": targets,
            "n_dropped": {"train": 0, "val": 0},
            "shards": shards,
            "mask_bits": {"target": MASK_TARGET, "doc_start": MASK_START},
            "rows": "pair i = rows 2i (chosen) and 2i + 1 (rejected), each right-padded",
            "chat_template": {"source": template.source},
            **Provenance(
                tok_ref, inputs, val_inputs, columns, val_fraction, seed, fingerprint, start, identity(tok)
            ).meta(bad),
        }
        publish_with_meta(tmp, out, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"prepare: wrote {out}: {n_pairs['train']:,} train / {n_pairs['val']:,} val pairs in rows of {row_len} tokens"
        f" ({targets['train']:,} train answer tokens); chat template: {template.source};"
        f" {bad.count} bad record(s) skipped" + "".join(f"\n  skipped   {line}" for line in bad.listed)
    )
    return meta


class PreferenceDataset(PackedDataset):
    """A prepared preference split read as pairs: sample ``i`` is rows ``2i`` (chosen) and ``2i + 1`` (rejected).

    With ``reference`` (``[pairs, 2]`` log-probs of the starting weights, ``deepzero.reference``) each sample
    also carries ``ref_logps``. :meth:`collate` stacks a micro-batch's chosen rows first, then its rejected rows
    (TRL's concatenated batch): ``input_ids`` [2 × micro, seq_len], ``ref_logps`` [micro, 2].
    """

    rows_per_sample = 2

    def __init__(self, data_dir: Path | str, split: str, documents: bool = True, vocab_size: int | None = None) -> None:
        super().__init__(data_dir, split, documents=True, vocab_size=vocab_size)  # one conversation per row
        self.reference: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n_rows // 2

    def check_rows(self, indices: list[int]) -> None:
        super().check_rows([r for i in indices for r in (2 * int(i), 2 * int(i) + 1)])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= int(i) < len(self):
            raise IndexError(f"pair {i} out of range for {len(self)} pairs")
        chosen, rejected = super().__getitem__(2 * int(i)), super().__getitem__(2 * int(i) + 1)
        sample = {k: torch.stack([chosen[k], rejected[k]]) for k in chosen}
        if self.reference is not None:
            sample["ref_logps"] = torch.from_numpy(self.reference[int(i)])
        return sample

    @staticmethod
    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(samples)
        return {k: v if k == "ref_logps" else v.transpose(0, 1).flatten(0, 1) for k, v in batch.items()}
