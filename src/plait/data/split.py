"""The train/validation split of a token stream: evenly spaced blocks, not the tail.

The default corpus is the standard library read in sorted path order, so a tail would be
the alphabetically last modules (zipfile, zoneinfo), not the corpus. Instead the stream is
cut into blocks of whole windows and an evenly spaced `val_fraction` of the blocks is held
out (`packing.val_split`, the instruction data's rule applied to blocks): validation samples
the whole stream, is the same for every seed, and depends only on the stream's length, so
raw text and shards of the same tokens split alike and a mapped stream is never read to
split it. A block is `block_windows * seq_len + 1` tokens: its windows share their boundary
tokens as consecutive windows always do, but no token is in two blocks, so no training
window shares a token with a validation window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.data.packing import val_split
from plait.errors import ConfigError

# Windows per block, at most: blocks long enough to hold a stretch of text (2K tokens at
# seq_len 128), short enough that validation is hundreds of places in the stream.
BLOCK_WINDOWS = 16
# Blocks shrink (down to one window) until the stream holds at least this many, so a small
# corpus still gets validation from many places and a share close to val_fraction.
MIN_BLOCKS = 100


@dataclass(frozen=True)
class Side:
    """One side of the split: which blocks it holds and how its windows map to tokens.

    Window `i` of the side is window `i % block_windows` of block
    `blocks[i // block_windows]`; only the stream's last block may hold fewer windows, and
    it is always the side's last."""

    blocks: np.ndarray  # int64 block ids, ascending
    block_windows: int
    seq_len: int
    windows: int
    stream_tokens: int  # the length of the stream this side was cut from

    def starts(self, idx: np.ndarray) -> np.ndarray:
        """The stream offsets of windows `idx` of this side (int64)."""
        k = self.block_windows
        block_tokens = k * self.seq_len + 1
        return self.blocks[idx // k] * block_tokens + (idx % k) * self.seq_len

    def spans(self) -> list[tuple[int, int]]:
        """The token range [a, b) each block's windows cover, in stream order."""
        k, s = self.block_windows, self.seq_len
        out = [(int(b) * (k * s + 1), int(b) * (k * s + 1) + k * s + 1) for b in self.blocks]
        if out and self.windows < len(out) * k:  # the stream's short last block
            a = out[-1][0]
            out[-1] = (a, a + (self.windows - (len(out) - 1) * k) * s + 1)
        return out


@dataclass(frozen=True)
class Split:
    """Both sides of a stream's split (`split_windows`)."""

    train: Side
    val: Side
    blocks: int


def split_windows(n_tokens: int, seq_len: int, val_fraction: float) -> Split:
    """Split a stream of `n_tokens` into training and validation windows of `seq_len`.

    Block windows `k = clamp((n_tokens - 1) // seq_len // MIN_BLOCKS, 1, BLOCK_WINDOWS)`;
    blocks of `k * seq_len + 1` tokens tile the stream from its start, a last short block
    keeps the whole windows that fit; validation is `packing.val_split` of the blocks
    (evenly spaced, at least one, never all). The one rule `corpus_from_tokens` splits by
    and `config._validate_corpus` counts by; a side may come out empty (a too-small
    stream), which the callers refuse with their own message.
    """
    if seq_len < 1:
        raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    k = min(BLOCK_WINDOWS, max(1, (max(n_tokens, 1) - 1) // seq_len // MIN_BLOCKS))
    block_tokens = k * seq_len + 1
    full, rest = divmod(max(n_tokens, 0), block_tokens)
    last = max(0, rest - 1) // seq_len  # windows of a short last block
    count = full + (1 if last else 0)
    if count < 2:  # too small to split: everything is training, the callers refuse it
        train_ids, val_ids = np.arange(count, dtype=np.int64), np.empty(0, np.int64)
    else:
        train_ids, val_ids = val_split(count, val_fraction)

    def side(ids: np.ndarray) -> Side:
        short = k - last if last and len(ids) and ids[-1] == count - 1 else 0
        return Side(ids, k, seq_len, len(ids) * k - short, n_tokens)

    return Split(side(train_ids), side(val_ids), count)


def whole_stream(n_tokens: int, seq_len: int) -> Side:
    """Every window of a stream as one side (one block): the training side of a run whose
    validation comes from another file (`--eval-data`), so nothing is held out."""
    k = max(0, n_tokens - 1) // seq_len
    return Side(np.zeros(1 if k else 0, np.int64), max(k, 1), seq_len, k, n_tokens)
