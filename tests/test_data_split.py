"""The train/validation split of a token stream (data/split.py): evenly spaced blocks of
windows, disjoint, deterministic, spread over the whole stream, and the same split the config
check counts. Pure: no corpus is read but a few in-memory arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.data import TokenWindows, baseline_sample, split_windows, unigram_entropy
from plait.data.split import BLOCK_WINDOWS, MIN_BLOCKS
from plait.errors import ConfigError

# (tokens, seq_len, val_fraction): tiny streams (one window a block), the middle where
# blocks grow, the default run's 8 MB at seq_len 128, and a short last block.
CASES = [
    (21, 2, 0.2),
    (500, 32, 0.05),
    (2_000, 32, 0.05),
    (40_000, 16, 0.1),
    (8_000_000, 128, 0.05),
    (100_003, 7, 0.3),
]


def _spans(n: int, seq: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Token offsets of every training and every validation window, read back through
    TokenWindows from a stream whose tokens are their own positions."""
    split = split_windows(n, seq, fraction)
    stream = np.arange(n, dtype=np.int64)
    starts = []
    for side in (split.train, split.val):
        rows = TokenWindows(stream, seq, side)
        assert len(rows) == side.windows
        x, y, segments = rows.draw(torch.arange(len(rows)))
        assert segments is None and rows.target_count(torch.arange(3)) == 3 * seq
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
        starts.append(x[:, 0].numpy())
    return starts[0], starts[1]


@pytest.mark.parametrize(("n", "seq", "fraction"), CASES)
def test_sides_are_disjoint_and_cover_the_blocks(n: int, seq: int, fraction: float) -> None:
    train, val = _spans(n, seq, fraction)
    split = split_windows(n, seq, fraction)
    k = split.train.block_windows
    assert k == min(BLOCK_WINDOWS, max(1, (n - 1) // seq // MIN_BLOCKS))
    # No token lies in a training window and a validation window (a window is seq + 1 tokens).
    covered = [np.zeros(n, bool), np.zeros(n, bool)]
    for mask, starts in zip(covered, (train, val), strict=True):
        for s in starts:
            mask[s : s + seq + 1] = True
    assert not (covered[0] & covered[1]).any()
    # Together the sides are every window of every block: all but a short tail of the stream.
    assert len(set(train) | set(val)) == len(train) + len(val)
    uncovered = n - int((covered[0] | covered[1]).sum())
    assert 0 <= uncovered < k * seq + 1
    # The share held out is val_fraction up to one block of rounding.
    share = len(val) / (len(train) + len(val))
    assert abs(share - fraction) <= k / (len(train) + len(val)) + 1 / split.blocks + 1e-9
    assert len(val) >= 1 and len(train) >= 1


@pytest.mark.parametrize(("n", "seq", "fraction"), CASES[2:])
def test_validation_is_spread_over_the_stream(n: int, seq: int, fraction: float) -> None:
    """Not a tail: validation windows start near the stream's start, end near its end, and no
    gap between them is much wider than the even spacing."""
    _, val = _spans(n, seq, fraction)
    blocks = split_windows(n, seq, fraction).val.blocks
    spacing = n / len(blocks)
    assert val.min() < spacing and val.max() > n - 2 * spacing
    assert np.diff(np.sort(val)).max() <= 2 * spacing


def test_the_split_is_deterministic_and_depends_on_the_length_alone() -> None:
    a, b = split_windows(100_000, 32, 0.1), split_windows(100_000, 32, 0.1)
    assert np.array_equal(a.val.blocks, b.val.blocks)
    assert np.array_equal(a.train.blocks, b.train.blocks)
    ones, rand = np.ones(100_000, np.uint8), np.random.default_rng(0).integers(0, 256, 100_000)
    idx = torch.arange(len(TokenWindows(ones, 32, a.val)))
    x_ones = TokenWindows(ones, 32, a.val).draw(idx)[0]
    x_pos = TokenWindows(np.arange(100_000), 32, a.val).draw(idx)[0]
    assert torch.equal(x_ones, torch.ones_like(x_ones))
    x_rand = TokenWindows(rand.astype(np.uint8), 32, a.val).draw(idx)[0]
    assert torch.equal(x_rand, torch.from_numpy(rand[x_pos.numpy()]).long())


def test_baseline_counts_training_tokens_only() -> None:
    n, seq = 50_000, 16
    split = split_windows(n, seq, 0.2)
    tokens = np.zeros(n, np.uint8)
    for a, b in split.val.spans():
        tokens[a:b] = 1  # validation's own symbol: the baseline must never see it
    sample = baseline_sample(tokens, split.train)
    assert len(sample) == sum(b - a for a, b in split.train.spans())
    assert unigram_entropy(sample) == 0.0 and (sample == 0).all()


def test_bad_splits_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"val_fraction.*1\.5"):
        split_windows(1000, 8, 1.5)
    with pytest.raises(ConfigError, match=r"val_fraction.*0\.0"):
        split_windows(1000, 8, 0.0)
    assert split_windows(5, 5, 0.1).train.windows == 0  # not one window
    one = split_windows(6, 5, 0.1)  # one window, one block: nothing left to hold out
    assert (one.train.windows, one.val.windows) == (1, 0)
    assert len(TokenWindows(np.arange(6), 5, one.train)) == 1
    with pytest.raises(ConfigError, match=r"6 tokens give this side.*no window of seq_len 5"):
        TokenWindows(np.arange(6), 5, one.val)
    other = split_windows(1000, 8, 0.1)
    with pytest.raises(ConfigError, match=r"split of 1000 tokens was given a stream of 999"):
        TokenWindows(np.arange(999), 8, other.train)
    with pytest.raises(ConfigError, match=r"made for seq_len 8 read at 4"):
        TokenWindows(np.arange(1000), 4, other.train)
