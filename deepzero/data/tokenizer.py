"""A small byte-level BPE tokenizer trained locally on the Python standard library (no downloads)."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

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
