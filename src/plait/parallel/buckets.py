"""Flat gradient buckets: the storage every data-parallel flavour reduces from.

Parameters are laid out in reverse order of registration, which approximates the order in
which backward produces their gradients (the last layer's first), so the first bucket fills
first and its reduction overlaps the rest of backward. Each bucket is one contiguous buffer;
a parameter's gradient is a view into it. ZeRO stages shard these same buffers, which is why
a bucket can be padded to a multiple of the data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """One flat buffer holding the gradients of consecutive parameters."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # without padding
    buffer: torch.Tensor  # (numel + padding,)
    pending: int = 0  # parameters whose gradient has not arrived in this backward
    launched: bool = False
    handle: object | None = None
    views: list[torch.Tensor] = field(default_factory=list)

    @property
    def padding(self) -> int:
        return self.buffer.numel() - self.numel


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in reverse order, into runs of at most `bucket_bytes` each.

    A parameter larger than the cap gets a bucket of its own: never split, so each gradient
    stays one view (as torch DDP does).
    """
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def build_buckets(
    params: list[nn.Parameter],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    pad_multiple: int = 1,
) -> list[Bucket]:
    """Allocate one zeroed flat buffer per bucket, padded to a multiple of `pad_multiple`."""
    buckets = []
    for i, group in enumerate(assign_buckets(params, bucket_bytes)):
        offsets, numel = [], 0
        for p in group:
            offsets.append(numel)
            numel += p.numel()
        padded = -(-numel // pad_multiple) * pad_multiple
        buf_dtype = dtype or group[0].dtype
        buffer = torch.zeros(padded, dtype=buf_dtype, device=group[0].device)
        views = [buffer[o : o + p.numel()].view_as(p) for p, o in zip(group, offsets, strict=True)]
        buckets.append(Bucket(i, group, offsets, numel, buffer, views=views))
    return buckets
