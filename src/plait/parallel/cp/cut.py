"""Which of a packed row's tokens each context-parallel rank holds (pure, no process).

Causal attention makes a document's late tokens cost more than its early ones (each sees
everything before it). Cutting each document into 2·cp equal pieces and giving rank r the
pieces r and 2cp−1−r pairs an early piece with a late one, so every rank does the same
attention work for that document (the head-tail balance of Megatron's and torch's context
parallelism, applied per document, since packed documents never see each other).

What equal pieces leave over is assigned whole to the least-loaded rank: the last
l mod 2cp tokens of each long document, and every document shorter than 2cp tokens. Every
rank holds exactly s/cp tokens of each row (tensors keep one shape), so an item that would
pass a rank's share is split at it and its rest goes on to the next least-loaded rank.

Any assignment is exact: attention compares tokens by their place in the row and their
document, never by where they sit on a rank. The cut only sets the work each rank does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def documents_of(runs_row: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of equal ids in one row, in order."""
    out, start = [], 0
    for i in range(1, len(runs_row) + 1):
        if i == len(runs_row) or runs_row[i] != runs_row[start]:
            out.append((start, i))
            start = i
    return out


def cut_row(documents: list[tuple[int, int]], cp: int) -> list[list[int]]:
    """Each rank's token places in one row of documents (start, end), ascending; every
    rank gets the same count (the row's length / cp, which must be whole)."""
    length = documents[-1][1] if documents else 0
    if length % cp:
        raise ValueError(f"a row of {length} tokens does not split over cp={cp} ranks")
    share = length // cp
    held: list[list[int]] = [[] for _ in range(cp)]
    rest: list[tuple[int, int]] = []  # what pieces leave: short documents, long ones' tails
    for start, end in documents:
        q = (end - start) // (2 * cp)
        if q == 0:
            rest.append((start, end))
            continue
        for r in range(cp):
            for piece in (r, 2 * cp - 1 - r):
                held[r].extend(range(start + piece * q, start + (piece + 1) * q))
        if start + 2 * cp * q < end:
            rest.append((start + 2 * cp * q, end))
    for start, end in rest:
        while start < end:
            r = min(range(cp), key=lambda k: len(held[k]))  # the least loaded, lowest first
            take = min(end - start, share - len(held[r]))
            held[r].extend(range(start, start + take))
            start += take
    return [sorted(h) for h in held]


def cut(runs: Tensor, cp: int) -> Tensor:
    """Every rank's token places (cp, b, s/cp) int64 for rows whose run ids are `runs`
    (b, s) (models/packing.py: a new id where a document starts)."""
    rows = [cut_row(documents_of(row), cp) for row in runs.tolist()]
    index = torch.tensor(rows, dtype=torch.int64, device=runs.device)  # (b, cp, s/cp)
    return index.transpose(0, 1).contiguous()
