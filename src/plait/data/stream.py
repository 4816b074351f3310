"""The token stream a run trains on: raw text read into memory, or prepared shards mapped.

`--data` names either; a folder with `index.json` is shards (memory-mapped, no full read),
anything else is raw text read up to `--max-bytes` and tokenized in memory (bytes by default,
or `--tokenizer`). Both give a stream that `split_windows` splits by its length alone and
`TokenWindows` cuts the same way, so shards and raw text of the same tokens train identically.
"""

from __future__ import annotations

import numpy as np

from plait.data.corpus import corpus_bytes_available, load_tokens
from plait.data.shards import ShardStream, is_shard_dir, read_index, shard_tokenizer
from plait.data.split import Side
from plait.data.tokenizer import BYTES, Encoder, TokenizerSpec, resolve_tokenizer

# The unigram baseline of a mapped stream is counted on its first tokens only: a full pass
# over a corpus much larger than memory would cost minutes at every start.
BASELINE_TOKENS = 1 << 24


def data_tokenizer(path: str | None, tokenizer: str | None) -> TokenizerSpec:
    """The tokenizer of a run's data: the shards' own (checked against `tokenizer` when
    given), else `tokenizer`, else bytes."""
    given = resolve_tokenizer(tokenizer) if tokenizer else None
    if is_shard_dir(path):
        return shard_tokenizer(path, given)
    return given or BYTES


def load_stream(
    path: str | None, tokenizer: str | None, max_bytes: int
) -> np.ndarray | ShardStream:
    """The run's whole token stream (train and validation, before the split)."""
    if is_shard_dir(path):
        data_tokenizer(path, tokenizer)  # the same check as before the workers started
        return ShardStream(path)
    tokens = load_tokens(path, max_bytes)
    if not tokenizer:
        return tokens
    return Encoder(resolve_tokenizer(tokenizer)).encode_text(tokens.tobytes())


def stream_length(path: str | None, tokenizer: str | None, max_bytes: int) -> int:
    """Tokens `load_stream` gives, as cheaply as it can be known: the shard index, the file
    sizes for bytes; raw text with a tokenizer is tokenized (that is the only way to know)."""
    if is_shard_dir(path):
        return int(read_index(path)["tokens"])
    if not tokenizer:
        return corpus_bytes_available(path, max_bytes)
    return len(load_stream(path, tokenizer, max_bytes))


def baseline_sample(tokens: np.ndarray | ShardStream, train: Side) -> np.ndarray:
    """The tokens the unigram baseline is counted on: those of every training block of an
    in-memory stream, of the first training blocks up to `BASELINE_TOKENS` of a mapped one
    (validation tokens never count: the baseline is what a context-free model learns)."""
    mapped = isinstance(tokens, ShardStream)
    limit = BASELINE_TOKENS if mapped else len(tokens)
    parts, total = [], 0
    for a, b in train.spans():
        if total >= limit:
            break
        parts.append(tokens.read(a, b) if mapped else tokens[a:b])
        total += b - a
    return np.concatenate(parts)[:limit] if parts else np.empty(0, np.int64)
