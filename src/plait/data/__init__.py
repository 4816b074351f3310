"""Data: the corpus (corpus.py, sources.py), tokenizers (tokenizer.py), token shards
(prepare.py, shards.py), the run's token stream (stream.py), its train/validation split
(split.py) and the sampler (sampler.py);
instruction data: templates (templates.py), rows of files (records.py), shards with targets
(instruct.py) and their packed rows (packing.py, examples.py)."""

from plait.data.corpus import (
    ByteTokenizer,
    corpus_bytes_available,
    corpus_files,
    default_corpus_dir,
    load_tokens,
    unigram_entropy,
)
from plait.data.sampler import (
    GlobalBatchSampler,
    TokenWindows,
    eval_indices,
    replica_share,
    split_micro,
)
from plait.data.split import Side, Split, split_windows
from plait.data.stream import baseline_sample, data_tokenizer, load_stream, stream_length

__all__ = [
    "ByteTokenizer",
    "GlobalBatchSampler",
    "Side",
    "Split",
    "TokenWindows",
    "baseline_sample",
    "corpus_bytes_available",
    "corpus_files",
    "data_tokenizer",
    "default_corpus_dir",
    "eval_indices",
    "load_stream",
    "load_tokens",
    "replica_share",
    "split_micro",
    "split_windows",
    "stream_length",
    "unigram_entropy",
]
