"""Where a rank's piece of a parameter sits in the single-process tensor, as boxes.

A checkpoint names every tensor by its single-process name and shape, so that any layout can
read any other's. A rank holds a piece of a parameter's state in two steps: tensor
parallelism gives it a rectangular slice of the full tensor (a `ShardSpec`, maybe with zero
padding after the vocabulary), and ZeRO gives it a flattened range of that slice, which can
start and end in the middle of a row. A flattened range of a row-major tensor is a few
rectangular boxes (a partial row, whole rows, a partial row, recursively for more dims),
each contiguous in memory, and `torch.distributed.checkpoint` saves and reshards boxes.

Pure arithmetic: no process, no tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.models.contract import ShardSpec


@dataclass(frozen=True)
class Box:
    """Elements [offsets, offsets + sizes) along every dim; `start` is where the box's data
    begins in the flattened range it came from (its elements follow there contiguously)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_boxes(shape: tuple[int, ...], start: int, length: int) -> list[Box]:
    """Elements [start, start + length) of a row-major tensor of `shape`, as boxes in order."""
    if length <= 0:
        return []
    if not shape:
        return [Box((), (), 0)]
    if len(shape) == 1:
        return [Box((start,), (length,), 0)]
    inner = math.prod(shape[1:])
    end = start + length
    boxes: list[Box] = []
    row, col = divmod(start, inner)
    if col:  # a partial first row
        n = min(inner - col, length)
        boxes += _in_row(shape, row, col, n, 0)
        row, col = row + 1, 0
    done = sum(b.numel for b in boxes)
    whole = (end - row * inner) // inner if end > row * inner else 0
    if whole > 0:
        boxes.append(Box((row, *(0,) * (len(shape) - 1)), (whole, *shape[1:]), done))
        done += whole * inner
        row += whole
    if done < length:  # a partial last row
        boxes += _in_row(shape, row, 0, length - done, done)
    return boxes


def _in_row(shape: tuple[int, ...], row: int, col: int, n: int, at: int) -> list[Box]:
    """Elements [col, col + n) of row `row` (the rest of the dims), shifted to `at`."""
    return [
        Box((row, *b.offsets), (1, *b.sizes), at + b.start) for b in range_boxes(shape[1:], col, n)
    ]


def to_global(box: Box, spec: ShardSpec | None) -> Box | None:
    """A box of the local (tp-shard) tensor in the full tensor's coordinates; the part in
    the shard's padding is cut off (None when nothing real is left). Padding lies after the
    real data along `spec.dim`, so cutting it keeps the box's data contiguous only when the
    box spans one index of every dim before `spec.dim`: true for the vocabulary, padded along
    dim 0."""
    if spec is None:
        return box
    end = box.offsets[spec.dim] + box.sizes[spec.dim]
    real = spec.local_shape[spec.dim]
    if box.offsets[spec.dim] >= real:
        return None
    sizes = list(box.sizes)
    if end > real:
        if any(box.sizes[d] != 1 for d in range(spec.dim)):
            raise ValueError(f"padding along dim {spec.dim} cuts box {box} non-contiguously")
        sizes[spec.dim] = real - box.offsets[spec.dim]
    offsets = tuple(o + g for o, g in zip(box.offsets, spec.offsets, strict=True))
    return Box(offsets, tuple(sizes), box.start)
