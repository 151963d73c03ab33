"""Data pipeline: a local BPE tokenizer, streaming input readers, and sharded packed datasets with a resumable sampler.

The build step is ``from deepzero.data.prepare import prepare`` (or ``python -m deepzero.data.prepare``); it is not
imported here, so that running it with ``-m`` does not import the module twice.
"""

from deepzero.data.dataset import (
    FORMAT_VERSION,
    IGNORE_INDEX,
    GlobalBatchSampler,
    MicroBatch,
    PackedDataset,
    check_enough_rows,
    eval_indices,
    eval_sample,
    load_meta,
    make_eval_loader,
    make_train_loader,
)
from deepzero.data.preference import PreferenceDataset
from deepzero.data.prompts import PromptDataset
from deepzero.data.sources import Corpus, Doc, iter_docs, read_corpus
from deepzero.data.tokenizer import SPECIAL_TOKENS, stdlib_corpus, train_tokenizer, train_tokenizer_from_texts


def open_split(data_dir: str, split: str, documents: bool = True, vocab_size: int | None = None) -> PackedDataset:
    """A prepared split as the dataset its format reads: rows (text, chat), pairs of rows (preference) or prompts
    (GRPO's prompts: ``documents`` has no meaning there and is ignored; ids are checked against ``vocab_size``)."""
    fmt = load_meta(data_dir)["format"]
    cls = {"preference": PreferenceDataset, "prompts": PromptDataset}.get(fmt, PackedDataset)
    return cls(data_dir, split, documents=documents, vocab_size=vocab_size)


__all__ = [
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "Corpus",
    "Doc",
    "GlobalBatchSampler",
    "MicroBatch",
    "PackedDataset",
    "PreferenceDataset",
    "PromptDataset",
    "check_enough_rows",
    "eval_indices",
    "eval_sample",
    "iter_docs",
    "load_meta",
    "make_eval_loader",
    "make_train_loader",
    "open_split",
    "read_corpus",
    "stdlib_corpus",
    "train_tokenizer",
    "train_tokenizer_from_texts",
]
