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
from deepzero.data.sources import Corpus, Doc, iter_docs, read_corpus
from deepzero.data.tokenizer import SPECIAL_TOKENS, stdlib_corpus, train_tokenizer, train_tokenizer_from_texts

__all__ = [
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "Corpus",
    "Doc",
    "GlobalBatchSampler",
    "MicroBatch",
    "PackedDataset",
    "check_enough_rows",
    "eval_indices",
    "eval_sample",
    "iter_docs",
    "load_meta",
    "make_eval_loader",
    "make_train_loader",
    "read_corpus",
    "stdlib_corpus",
    "train_tokenizer",
    "train_tokenizer_from_texts",
]
