"""Token windows and the resumable global-batch sampler.

Exactness across layouts rests on one idea: every rank derives the *global* batch of a
step from the same seeded sampler, then takes its share of it. The single-process
reference and any dp x pp x tp layout therefore train on exactly the same windows each
step, and a window's position in the global batch (not the rank that holds it) keys
anything random about it, such as dropout masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from plait.data.shards import ShardStream
from plait.data.split import Side
from plait.errors import ConfigError


def _as_index_tensor(indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(indices, dtype=torch.int64).reshape(-1)


class Rows(Protocol):
    """What the sampler draws from: rows of `seq_len` tokens with their targets (IGNORE where
    a token is no target, models/loss.py) and, for packed rows, their segments (models/
    packing.py). `TokenWindows` is one (every target counts, no segments); instruction
    data's packed rows are the other."""

    seq_len: int

    def __len__(self) -> int: ...

    def draw(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens (b, s), targets (b, s) and segments (b, s) or None, all int64."""
        ...

    def target_count(self, idx: torch.Tensor) -> int:
        """Targets that are not IGNORE in rows `idx`: known before the step, no collective."""
        ...


class TokenWindows:
    """Non-overlapping next-token windows over a token stream.

    Window ``i`` starts at ``i * seq_len``; its input is ``seq_len`` tokens and its
    target the same span shifted by one, so a window needs ``seq_len + 1`` tokens and
    there are ``(len(tokens) - 1) // seq_len`` of them. Given a `side` of the stream's
    train/validation split (data/split.py), the windows are that side's instead, each
    starting where `side.starts` says; the stream itself is shared, not copied.
    """

    def __init__(
        self, tokens: np.ndarray | ShardStream, seq_len: int, side: Side | None = None
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
        if side is not None and side.seq_len != seq_len:
            raise ConfigError(f"a split made for seq_len {side.seq_len} read at {seq_len}")
        self._side = side
        if isinstance(tokens, ShardStream):  # memory-mapped: windows are read when drawn
            self._init_mapped(tokens, seq_len)
            return
        self._stream: ShardStream | None = None
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
        if len(arr) < seq_len + 1:
            raise ConfigError(
                f"{len(arr)} tokens are too few for one window of seq_len {seq_len} "
                f"(need at least {seq_len + 1})"
            )
        if not arr.flags.writeable:  # torch.from_numpy warns on read-only buffers
            arr = arr.copy()
        self.seq_len = seq_len
        self._tokens = torch.from_numpy(np.ascontiguousarray(arr))
        self._num = self._count(len(arr), seq_len)
        self._offsets = torch.arange(seq_len + 1, dtype=torch.int64)

    def _count(self, n_tokens: int, seq_len: int) -> int:
        if self._side is None:
            return (n_tokens - 1) // seq_len
        if self._side.stream_tokens != n_tokens:
            raise ConfigError(
                f"a split of {self._side.stream_tokens} tokens was given a stream of {n_tokens}"
            )
        if self._side.windows < 1:
            raise ConfigError(
                f"{n_tokens} tokens give this side of the train/validation split no window "
                f"of seq_len {seq_len}; use more data or a shorter seq_len"
            )
        return self._side.windows

    def _init_mapped(self, stream: ShardStream, seq_len: int) -> None:
        if len(stream) < seq_len + 1:
            raise ConfigError(
                f"{len(stream)} tokens are too few for one window of seq_len {seq_len} "
                f"(need at least {seq_len + 1})"
            )
        self.seq_len, self._stream = seq_len, stream
        self._num = self._count(len(stream), seq_len)

    def __len__(self) -> int:
        return self._num

    def batch(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for the given windows, both int64 of shape (b, seq_len)."""
        idx = _as_index_tensor(indices)
        if idx.numel() and (idx.min() < 0 or idx.max() >= self._num):
            raise IndexError(
                f"window indices must lie in 0..{self._num - 1}, "
                f"got min {int(idx.min())} and max {int(idx.max())}"
            )
        if self._side is not None:
            starts = torch.from_numpy(self._side.starts(idx.numpy()))
        else:
            starts = idx * self.seq_len
        if self._stream is not None:
            spans = torch.from_numpy(self._stream.take(starts.numpy(), self.seq_len + 1))
        else:
            spans = self._tokens[starts[:, None] + self._offsets].long()  # (b, s+1)
        return spans[:, :-1].contiguous(), spans[:, 1:].contiguous()

    def draw(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """`Rows.draw`: plain causal windows, so no segments."""
        x, y = self.batch(idx)
        return x, y, None

    def target_count(self, idx: torch.Tensor) -> int:
        """`Rows.target_count`: every token of a window is a target."""
        return len(_as_index_tensor(idx)) * self.seq_len


def _epoch_seed(seed: int, epoch: int) -> int:
    # SeedSequence mixes (seed, epoch) into well-separated 64-bit seeds and gives the
    # same value on every platform; seed and epoch must be non-negative for it.
    state = np.random.SeedSequence([seed % 2**64, epoch]).generate_state(1, np.uint64)
    return int(state[0])


class GlobalBatchSampler:
    """Yields the window indices of each step's global batch, identically on every rank.

    An epoch is a permutation of all windows drawn from a generator seeded by
    (seed, epoch); batches are consecutive slices of it, and a remainder too small for
    a batch is dropped. The state is just (epoch, position), so resuming from a
    checkpoint replays exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, num_windows: int, global_batch: int, seed: int) -> None:
        if global_batch < 1:
            raise ConfigError(f"global_batch must be at least 1, got {global_batch}")
        if num_windows < global_batch:
            raise ConfigError(
                f"the corpus gives {num_windows} windows, fewer than one global batch of "
                f"{global_batch}; use more data, a shorter seq_len or a smaller batch"
            )
        self.num_windows = num_windows
        self.global_batch = global_batch
        self.seed = seed
        self._set_state(0, 0)

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches in one epoch (the remainder is dropped)."""
        return self.num_windows // self.global_batch

    @property
    def epoch(self) -> int:
        """The epoch the next batch is drawn from (rolls over lazily)."""
        return self._epoch

    def _set_state(self, epoch: int, position: int) -> None:
        gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        self._perm = torch.randperm(self.num_windows, generator=gen, dtype=torch.int64)
        self._epoch = epoch
        self._position = position

    def next_batch(self) -> torch.Tensor:
        """The next global batch of window indices, int64 of shape (global_batch,)."""
        if self._position + self.global_batch > self.num_windows:
            self._set_state(self._epoch + 1, 0)
        start = self._position
        self._position += self.global_batch
        return self._perm[start : self._position].clone()

    def state_dict(self) -> dict[str, int]:
        """Where the sampler stands: enough to continue with exactly the same batches."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``; must come from a sampler with the same
        num_windows, global_batch and seed for the batches to match."""
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ConfigError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_windows:
            raise ConfigError(
                f"sampler state epoch {epoch}, position {position} is invalid for "
                f"{self.num_windows} windows"
            )
        self._set_state(epoch, position)


def replica_share(
    indices: torch.Tensor, dp_rank: int, dp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One data-parallel replica's contiguous share of a global batch.

    Returns (window indices, their positions in the global batch). Every rank of a
    replica (its tp and pp peers) passes the same dp_rank and gets the same data; the
    positions let per-sample randomness depend on the sample, not on the layout.
    """
    global_batch = len(indices)
    if dp < 1 or global_batch % dp:
        raise ConfigError(
            f"global batch {global_batch} is not divisible by data-parallel size {dp}"
        )
    if not 0 <= dp_rank < dp:
        raise ConfigError(f"dp_rank {dp_rank} is outside 0..{dp - 1} for dp {dp}")
    share = global_batch // dp
    positions = torch.arange(dp_rank * share, (dp_rank + 1) * share, dtype=torch.int64)
    return indices[positions], positions


def split_micro(t: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    """Consecutive micro-batches of ``micro_batch`` rows each, in order."""
    if micro_batch < 1 or len(t) % micro_batch:
        raise ConfigError(f"batch of {len(t)} is not divisible by micro_batch {micro_batch}")
    return list(t.split(micro_batch))


def eval_indices(num_windows: int, count: int) -> torch.Tensor:
    """``min(count, num_windows)`` evenly spaced validation windows, always the same ones.

    A fixed set (not a fresh random sample) makes validation losses of different steps,
    runs and layouts directly comparable.
    """
    if num_windows < 1 or count < 1:
        raise ConfigError(
            f"eval needs at least one window and count >= 1, got {num_windows} windows "
            f"and count {count}"
        )
    n = min(count, num_windows)
    return torch.arange(n, dtype=torch.int64) * num_windows // n
