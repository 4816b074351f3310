"""Data: the corpus as byte tokens (corpus.py) and the global-batch sampler (sampler.py)."""

from plait.data.corpus import (
    ByteTokenizer,
    corpus_bytes_available,
    corpus_files,
    default_corpus_dir,
    load_tokens,
    split_tokens,
    unigram_entropy,
)
from plait.data.sampler import (
    GlobalBatchSampler,
    TokenWindows,
    eval_indices,
    replica_share,
    split_micro,
)

__all__ = [
    "ByteTokenizer",
    "GlobalBatchSampler",
    "TokenWindows",
    "corpus_bytes_available",
    "corpus_files",
    "default_corpus_dir",
    "eval_indices",
    "load_tokens",
    "replica_share",
    "split_micro",
    "split_tokens",
    "unigram_entropy",
]
