"""Keyed (counter-based) dropout: the mask is a pure function of where an element is.

plait promises that every parallel layout reproduces single-process training exactly,
dropout included. torch's dropout draws from a stateful generator, so its mask depends on
how many numbers were drawn before, i.e. on which rank holds which samples, heads or
sequence positions. Here an element is kept iff

    hash(sample key, dropout site, element's linear index in the sample's *global* tensor)

is above a threshold, so a rank that holds a slice of the batch, of the heads or of the
sequence computes exactly the slice of the mask the single process computes. This is the
idea of counter-based generators (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011) with a cheap integer hash in place of Philox.

Everything is int64 tensor arithmetic on values in [0, 2^32), so it runs the same on any
device (including meta) without custom kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

MASK32 = 0xFFFFFFFF
# Arbitrary odd constants that keep an all-zero input from hashing to zero (hash32(0) == 0).
_KEY_SALT = 0x9E3779B9
_SITE_SALT = 0x85EBCA6B
_ELEM_SALT = 0xC2B2AE35


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without leaving int64.

    x * c can reach 2^64 and overflow int64, so c is split into 16-bit halves: x * lo and
    x * hi are both below 2^48, and only the low 16 bits of x * hi survive the shift.
    """
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: Tensor) -> Tensor:
    """Mix 32-bit integers (held in int64 in [0, 2^32)) into well-spread 32-bit integers.

    Chris Wellons' "lowbias32" (xor-shift-multiply, the shape of the murmur3 finalizer),
    a bijection on [0, 2^32) with very low avalanche bias.
    """
    if x.dtype != torch.int64:
        raise TypeError(f"hash32 expects an int64 tensor, got {x.dtype}")
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h: Tensor, value: int | Tensor) -> Tensor:
    """Fold a (possibly 64-bit, possibly negative) integer into the running hash h."""
    h = hash32(h ^ (value & MASK32))
    return hash32(h ^ ((value >> 32) & MASK32))


def sample_keys(seed: int, step: int, positions: Tensor) -> Tensor:
    """Dropout key per sample from the run seed, the optimizer step and the global position.

    `positions` are the samples' indices in the global batch (not in a rank's shard), so the
    same sample gets the same key whichever data-parallel rank or micro-batch holds it.
    Returns int64 values in [0, 2^32), shaped like `positions`.
    """
    h = torch.tensor(_KEY_SALT, dtype=torch.int64, device=positions.device)
    h = _absorb(_absorb(h, seed), step)
    return _absorb(h, positions.to(torch.int64))


def _check_slice(
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...] | None,
    offsets: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (global_shape, offsets) with defaults filled in; raise naming bad values."""
    if global_shape is None:
        if offsets is not None and any(offsets):
            raise ValueError(f"offsets={offsets} given without global_shape")
        return local_shape, (0,) * len(local_shape)
    offsets = (0,) * len(local_shape) if offsets is None else tuple(offsets)
    global_shape = tuple(global_shape)
    if not len(local_shape) == len(global_shape) == len(offsets):
        raise ValueError(
            f"local_shape={local_shape}, global_shape={global_shape} and offsets={offsets} "
            "must have the same number of dimensions"
        )
    for dim, (n, g, o) in enumerate(zip(local_shape, global_shape, offsets, strict=True)):
        if o < 0 or o + n > g:
            raise ValueError(
                f"dim {dim}: slice [{o}:{o + n}] lies outside the global size {g} "
                f"(local_shape={local_shape}, global_shape={global_shape}, offsets={offsets})"
            )
    return global_shape, offsets


def _global_index(
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    device: torch.device,
) -> Tensor:
    """Row-major linear index in the global tensor of every local element, shape local_shape."""
    ndim = len(local_shape)
    index = torch.zeros((1,) * ndim, dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(ndim)):
        view = [1] * ndim
        view[dim] = local_shape[dim]
        coord = torch.arange(local_shape[dim], dtype=torch.int64, device=device) + offsets[dim]
        index = index + (coord * stride).view(view)
        stride *= global_shape[dim]
    return index.expand(local_shape)


def keep_mask(
    keys: Tensor,
    site: int,
    local_shape: tuple[int, ...],
    p: float,
    global_shape: tuple[int, ...] | None = None,
    offsets: tuple[int, ...] | None = None,
) -> Tensor:
    """Boolean keep-mask of shape (b, *local_shape) for per-sample keys of shape (b,).

    Element e of sample i is kept iff hash(keys[i], site, global index of e) / 2^32 >= p.
    With `global_shape` and `offsets` the local tensor is the slice
    [offsets[d] : offsets[d] + local_shape[d]] of a per-sample tensor of `global_shape`
    (a tensor- or sequence-parallel shard); the result is then exactly that slice of the
    mask the whole tensor would get.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if keys.dim() != 1:
        raise ValueError(f"keys must have shape (batch,), got {tuple(keys.shape)}")
    local_shape = tuple(int(n) for n in local_shape)
    global_shape, offsets = _check_slice(local_shape, global_shape, offsets)
    index = _global_index(local_shape, global_shape, offsets, keys.device)

    site_h = _absorb(torch.tensor(_SITE_SALT, dtype=torch.int64, device=keys.device), site)
    k1 = hash32((keys.to(torch.int64) & MASK32) ^ site_h)  # (b,)
    k2 = hash32(k1 ^ _ELEM_SALT)  # (b,) second round key, so samples are not shifted copies
    bview = (-1,) + (1,) * len(local_shape)
    h = hash32((index & MASK32) ^ k1.view(bview))  # (b, *local_shape)
    if math.prod(global_shape) > MASK32:  # indices need more than 32 bits
        h = hash32(h ^ (index >> 32))
    h = hash32((h + k2.view(bview)) & MASK32)
    # uniform = h / 2^32 >= p  <=>  h >= ceil(p * 2^32): an exact integer comparison.
    return h >= math.ceil(p * 2**32)


class KeyedDropout(nn.Module):
    """Inverted dropout whose mask comes from `keep_mask`, so every layout agrees on it.

    `site` is a structural id (fixed by the model, e.g. layer * 4 + kind) that makes the
    masks of different dropout calls independent for the same sample key.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.site = site

    def forward(
        self,
        x: Tensor,
        keys: Tensor | None,
        global_shape: tuple[int, ...] | None = None,
        offsets: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Drop elements of x (batch first) with probability p and rescale by 1/(1-p).

        keys=None draws keys from torch's default generator: plain usage works, and
        torch.utils.checkpoint's RNG preservation replays the same keys on recompute.
        `global_shape`/`offsets` describe x[i] as a slice of a larger per-sample tensor.
        """
        if not self.training or self.p == 0.0:
            return x
        if keys is None:
            keys = torch.randint(0, 2**32, (x.shape[0],), dtype=torch.int64, device=x.device)
        mask = keep_mask(keys, self.site, tuple(x.shape[1:]), self.p, global_shape, offsets)
        return x * mask / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
