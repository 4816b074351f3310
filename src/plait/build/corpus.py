"""The corpus a rank trains and validates on: raw text, prepared shards or an examples folder.

Every rank builds the same corpus (deterministic), and each then draws its replica's share of
every global batch from it (`data/batches.py`).
"""

from __future__ import annotations

import numpy as np

from plait.config import Config
from plait.data import baseline_sample, load_stream, split_windows, unigram_entropy
from plait.data.batches import Corpus
from plait.data.examples import example_corpus, is_examples_dir
from plait.data.sampler import TokenWindows
from plait.data.shards import ShardStream
from plait.data.split import whole_stream


def load_corpus(cfg: Config) -> Corpus:
    """Raw text read into memory, prepared shards memory-mapped (data/stream.py), or an
    examples folder's packed rows (data/examples.py: IGNORE targets and segments, which the
    model and the loss rule consume; every rank builds the same rows)."""
    d = cfg.data
    if is_examples_dir(d.path):
        made = example_corpus(d.path, cfg.train.seq_len, d.val_fraction, d.pack, d.long,
                              d.eval_data)  # fmt: skip
        return Corpus(made.train, made.val, made.baseline, made.report)
    tokens = load_stream(d.path, d.tokenizer, d.max_bytes)
    if d.eval_data is not None:
        return corpus_with_eval(tokens, load_stream(d.eval_data, d.tokenizer, d.max_bytes), cfg)
    return corpus_from_tokens(tokens, cfg)


def corpus_from_tokens(tokens: np.ndarray | ShardStream, cfg: Config) -> Corpus:
    """Training and validation windows of one stream, split by `split_windows` (evenly
    spaced blocks, data/split.py); both sides read the same tokens, nothing is copied."""
    seq = cfg.train.seq_len
    split = split_windows(len(tokens), seq, cfg.data.val_fraction)
    if not isinstance(tokens, ShardStream) and not tokens.flags.writeable:
        tokens = tokens.copy()  # TokenWindows would copy a read-only array once per side
    baseline = unigram_entropy(baseline_sample(tokens, split.train))
    return Corpus(
        TokenWindows(tokens, seq, split.train), TokenWindows(tokens, seq, split.val), baseline
    )


def corpus_with_eval(
    tokens: np.ndarray | ShardStream, held: np.ndarray | ShardStream, cfg: Config
) -> Corpus:
    """Every window of `tokens` to train on, every window of `held` (`--eval-data`) to
    validate on: nothing of the training stream is held out."""
    seq = cfg.train.seq_len
    tokens, held = (t if isinstance(t, ShardStream) or t.flags.writeable else t.copy()
                    for t in (tokens, held))  # fmt: skip
    train = whole_stream(len(tokens), seq)
    baseline = unigram_entropy(baseline_sample(tokens, train))
    return Corpus(TokenWindows(tokens, seq, train),
                  TokenWindows(held, seq, whole_stream(len(held), seq)), baseline)  # fmt: skip
