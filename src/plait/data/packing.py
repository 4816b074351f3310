"""Rows from example lengths: best-fit decreasing packing, or one example a row.

Pure arithmetic on the index's lengths, so the rows of any `seq_len` are known before a
token is read (the launcher checks them; every rank builds the same rows). An example of
L tokens fills L - 1 input positions (its inputs are tokens[:-1], its targets tokens[1:]);
a row has `seq_len` positions. An example longer than seq_len + 1 tokens is cut to
seq_len + 1 (`long="truncate"`, as Stanford's train.py truncates at model_max_length) or
left out (`long="drop"`); a truncated example whose first target lies past the cut would
train on nothing and is refused.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from plait.errors import ConfigError

LONG = ("truncate", "drop")


@dataclass(frozen=True)
class RowAssignment:
    """Which examples each row holds, in order, and how many positions each fills."""

    seq_len: int
    row_start: np.ndarray  # (rows + 1,) offsets into the placements
    example: np.ndarray  # (placements,) example id
    positions: np.ndarray  # (placements,) input positions filled (tokens used - 1)
    truncated: int
    dropped: int

    @property
    def rows(self) -> int:
        return len(self.row_start) - 1

    @property
    def efficiency(self) -> float:
        """Real input positions over all row positions (1 - the padding share)."""
        return float(self.positions.sum()) / max(1, self.rows * self.seq_len)


def fit(
    ids: np.ndarray, lengths: np.ndarray, first_target: np.ndarray, seq_len: int, long: str
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(kept ids, their positions, truncated, dropped) after the `long` rule; ConfigError for
    a truncated example whose first target falls beyond the row."""
    if long not in LONG:
        raise ConfigError(f"long must be one of {', '.join(LONG)}; got {long!r}")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
    too_long = lengths > seq_len + 1
    if long == "truncate":
        cut_off = too_long & (first_target > seq_len)
        if cut_off.any():
            at = int(np.flatnonzero(cut_off)[0])
            raise ConfigError(
                f"example {int(ids[at])} has {int(lengths[at])} tokens and its first target at "
                f"token {int(first_target[at])}, beyond seq_len {seq_len} (+1): truncated, it "
                f"would train on nothing ({int(cut_off.sum())} such examples); use --long drop "
                "or a longer --seq-len"
            )
    keep = lengths >= 2 if long == "truncate" else (lengths >= 2) & ~too_long
    positions = np.minimum(lengths, seq_len + 1) - 1
    truncated = int(too_long.sum()) if long == "truncate" else 0
    return ids[keep], positions[keep], truncated, int((~keep).sum())


def dropped_reason(lengths, seq_len: int, long: str) -> str:
    """Why examples are missing from the rows, for a message that finds too few of them:
    how many `--long drop` leaves out (all of them said so, with the `--seq-len` that keeps
    the shortest), or '' when it drops none."""
    lengths = np.asarray(lengths)
    too_long = lengths > seq_len + 1
    n = int(too_long.sum())
    if long != "drop" or n == 0:
        return ""
    if n == len(lengths):
        return (
            f"every one of the {n:,} examples is longer than seq_len {seq_len} + 1 tokens (the "
            f"shortest has {int(lengths.min()):,}), and --long drop leaves them all out: give "
            f"--seq-len {int(lengths.min()) - 1} or more, or --long truncate"
        )
    return (
        f"--long drop left out {n:,} of {len(lengths):,} examples, longer than {seq_len + 1} tokens"
    )


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (indices into `sizes`) in bins of `capacity`: the largest item first (ties by
    index), each into the open bin with the least room that holds it, else a new bin.
    Deterministic: a bin's room ties go to the older bin."""
    order = np.lexsort((np.arange(len(sizes)), -sizes))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room, bin), sorted: bisect finds the best fit
    for item in order.tolist():
        size = int(sizes[item])
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(item)
        if room - size > 0:
            bisect.insort(free, (room - size, b))
    return bins


def assign_rows(
    ids: np.ndarray, lengths: np.ndarray, first_target: np.ndarray, seq_len: int,
    pack: bool, long: str,
) -> RowAssignment:  # fmt: skip
    """The rows of the examples `ids` (with their lengths and first targets)."""
    kept, positions, truncated, dropped = fit(
        np.asarray(ids), np.asarray(lengths), np.asarray(first_target), seq_len, long
    )
    bins = best_fit_decreasing(positions, seq_len) if pack else [[i] for i in range(len(kept))]
    flat = np.array([i for b in bins for i in b], dtype=np.int64)
    row_start = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    return RowAssignment(seq_len, row_start, kept[flat], positions[flat], truncated, dropped)


def val_split(count: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, validation ids): validation is `int(count * val_fraction)` examples (at
    least one), evenly spaced through the file (example i * count // n), so it samples the
    whole file rather than its tail, and it is the same examples for every seq_len, pack
    and long setting (those are applied to each side after the split)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if count < 2:
        raise ConfigError(f"{count} example(s) cannot be split into training and validation")
    n = min(count - 1, max(1, int(count * val_fraction)))
    val = np.arange(n, dtype=np.int64) * count // n
    train = np.setdiff1d(np.arange(count, dtype=np.int64), val)
    return train, val


def length_report(lengths, first_target, seq_len: int, long: str) -> str:
    """What `seq_len` does to the examples, for `prepare --seq-len`: how many are longer
    than a row and would be truncated (and of those, how many keep no target) or dropped."""
    lengths, first = np.asarray(lengths), np.asarray(first_target)
    too_long = lengths > seq_len + 1
    n = int(too_long.sum())
    head = (
        f"at seq_len {seq_len}: {n:,} of {len(lengths):,} examples are longer than "
        f"{seq_len + 1} tokens"
    )
    if long == "drop":
        return f"{head} and would be dropped (--long drop)"
    lost = int((too_long & (first > seq_len)).sum())
    tail = (
        f"; {lost:,} of them keep no target, so training refuses --long truncate: use --long drop"
        if lost
        else ""
    )
    return f"{head} and would be truncated (--long truncate){tail}"
