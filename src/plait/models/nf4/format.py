"""NF4 with double quantization, byte for byte bitsandbytes' format (QLoRA's, and what a
Hugging Face checkpoint saved with `load_in_4bit` holds).

A weight of n elements, flattened row-major, is cut into blocks of 64. Each block is divided
by its absolute maximum (its `absmax`) into [-1, 1] and every element becomes the index of
the nearest of the 16 NormalFloat values (`NF4`: quantiles of N(0, 1) scaled to [-1, 1], with
an exact zero), ties to the lower value; two indices per byte, the first in the high nibble.
Double quantization then stores the absmax values in 8 bits: their mean (`offset`) is
subtracted, they are cut into blocks of 256, and each is divided by its block's absolute
maximum (`nested`, fp32) and coded as the nearest value of the signed 8-bit dynamic map
(`dynamic_map`: a dynamic exponent and fraction, Dettmers, 2016). Dequantization is

    absmax_b = DYN[absmax_code_b] * nested[b // 256] + offset        (fp32, in that order)
    w_i      = NF4[code_i] * absmax_(i // 64)                        (fp32, then the dtype)

Bits per weight: 4 + 8/64 + 32/(64 * 256) = 4.127 (+ 4 bytes of offset per weight).

A tensor-parallel rank holds a slice cut on 64-block boundaries (`take_rows`, `take_cols`):
its codes and its blocks' absmax codes, with the whole weight's `nested` and `offset` (1/16384
of the weight, and one number), so its dequantized slice is bit for bit the same slice of
the whole weight's: every layout computes with the same values. `BlockGrid` says which of
the whole weight's blocks a slice holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import Tensor

BLOCK = 64  # weights per absmax
NESTED_BLOCK = 256  # absmax values per nested scale

NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 NormalFloat values, sorted, as fp32 (QLoRA's appendix; bitsandbytes' table)."""


def nf4_table() -> Tensor:
    return torch.tensor(NF4, dtype=torch.float32)


@cache
def _dynamic_values() -> tuple[float, ...]:
    """bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True, 7, 8)): for
    exponent i in 0..6, 2^i fractions (the means of linspace(0.1, 1, 2^i + 1)'s neighbours)
    times 10^(i - 6), both signs; then 0 and 1; 256 values, sorted. Each fraction is an fp32
    product, as there, so the table is the same to the bit. Computed once (a tuple: nothing
    cached can be changed)."""
    data: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist()
        data += (-(10 ** (i - 6)) * means).tolist()
    return tuple(sorted([*data, 0.0, 1.0]))


def dynamic_map() -> Tensor:
    """The 256 values an absmax code stands for (`_dynamic_values`), fp32."""
    return torch.tensor(_dynamic_values(), dtype=torch.float32)


@dataclass(frozen=True)
class BlockGrid:
    """Which 64-blocks of the whole weight a tensor holds, in its order: `rows` runs of
    `cols` consecutive blocks, run r starting at block `first + r * stride`. A whole weight
    is one run; a column-parallel slice (whole rows) one run; a row-parallel slice one run
    per row."""

    first: int
    rows: int
    cols: int
    stride: int

    @property
    def blocks(self) -> int:
        return self.rows * self.cols

    def ids(self, device: torch.device | None = None) -> Tensor:
        """The whole weight's block index of each block held (int64)."""
        rows = torch.arange(self.rows, device=device) * self.stride + self.first
        return (rows[:, None] + torch.arange(self.cols, device=device)).reshape(-1)


@dataclass(frozen=True)
class NF4Tensor:
    """A weight, or a slice of one, in NF4 with double quantization. `shape`: the local
    shape; `dtype`: the dtype it was quantized from (what bitsandbytes records)."""

    codes: Tensor  # uint8 (ceil(n / 2),)
    absmax: Tensor  # uint8 (blocks,): the absmax codes of the blocks held
    nested: Tensor  # fp32 (ceil(whole blocks / 256),): the whole weight's
    offset: Tensor  # fp32 (): the whole weight's
    shape: tuple[int, ...]
    dtype: torch.dtype
    grid: BlockGrid

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, absmax codes, nested scales and the offset."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.codes, self.absmax, self.nested, self.offset

    def with_tensors(self, tensors: tuple[Tensor, ...]) -> NF4Tensor:
        """The same weight over other storage (a gathered or moved copy)."""
        codes, absmax, nested, offset = tensors
        return replace(self, codes=codes, absmax=absmax, nested=nested, offset=offset)


NF4Source = Callable[[str, tuple[int, ...]], NF4Tensor]
"""(single-process name, whole shape) -> that whole weight in NF4 (models/nf4/source.py)."""


def _blocks(flat: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Each block's absolute maximum and the values divided by it, clamped to [-1, 1]
    (a last short block has its own), as bitsandbytes computes them: x * (1 / absmax)."""
    n = flat.numel()
    full = n - n % block
    body = flat[:full].reshape(-1, block)
    absmax = body.abs().max(dim=-1).values
    scaled = torch.clamp(body * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if full < n:
        tail = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail, -1, 1)])
    return absmax, scaled


def _nearest(scaled: Tensor, table: Tensor) -> Tensor:
    """Index of the nearest value of the sorted `table`; a tie goes to the lower value."""
    bounds = (table[:-1] + table[1:]) / 2
    return torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)


def quantize_blockwise(values: Tensor, block: int = NESTED_BLOCK) -> tuple[Tensor, Tensor]:
    """8-bit dynamic-map codes of `values` in blocks of `block`, and each block's scale."""
    scale, scaled = _blocks(values.reshape(-1).float(), block)
    return _nearest(scaled, dynamic_map().to(values.device)), scale


def quantize(weight: Tensor) -> NF4Tensor:
    """`weight` in NF4 with double quantization (bitsandbytes' quantize_4bit, blocksize 64,
    quant_type nf4, compress_statistics True)."""
    flat = weight.reshape(-1).float()
    absmax, scaled = _blocks(flat, BLOCK)
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    q = _nearest(scaled, nf4_table().to(weight.device))
    codes = (q[::2] << 4) | q[1::2]
    offset = absmax.mean()
    absmax_codes, nested = quantize_blockwise(absmax - offset)
    blocks = absmax.numel()
    grid = BlockGrid(0, 1, blocks, blocks)
    return NF4Tensor(codes, absmax_codes, nested, offset, tuple(weight.shape), weight.dtype, grid)


def block_scales(t: NF4Tensor) -> Tensor:
    """The fp32 absmax of each block held: DYN[code] * nested[block // 256] + offset."""
    ids = t.grid.ids(t.absmax.device) // NESTED_BLOCK
    scale = _lookup(dynamic_map().to(t.absmax.device), t.absmax) * _lookup(t.nested, ids)
    return scale + t.offset


def _lookup(table: Tensor, index: Tensor) -> Tensor:
    """table[index] (index_select on int32 indices: tens of times faster on a CPU than
    advanced indexing with int64, the same values)."""
    return torch.index_select(table, 0, index.reshape(-1).to(torch.int32))


def dequantize(t: NF4Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The weight (or slice) `t` holds, in `dtype` (default: the dtype it came from):
    NF4[code] * absmax in fp32, rounded once to `dtype`."""
    n = t.numel
    q = torch.stack((t.codes >> 4, t.codes & 0xF), dim=-1).reshape(-1)[:n]
    values = _lookup(nf4_table().to(t.codes.device), q)
    scales = block_scales(t)
    full = n - n % BLOCK
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    out[:full] = (values[:full].view(-1, BLOCK) * scales[: full // BLOCK].view(-1, 1)).reshape(-1)
    if full < n:
        out[full:] = values[full:] * scales[-1]
    return out.reshape(t.shape).to(dtype or t.dtype)


def take_rows(t: NF4Tensor, r0: int, r1: int) -> NF4Tensor:
    """Rows [r0, r1) of a whole 2-D weight (a column-parallel slice): they must start and
    end on a 64-block boundary, so the slice's blocks are whole blocks of the weight."""
    out_f, in_f = t.shape
    lo, hi = r0 * in_f, r1 * in_f
    if lo % BLOCK or (hi % BLOCK and hi != t.numel) or t.grid.rows != 1 or t.grid.first:
        raise ValueError(f"rows [{r0}, {r1}) of a {out_f}x{in_f} weight cut a block of {BLOCK}")
    b0, b1 = lo // BLOCK, -(-hi // BLOCK)
    grid = BlockGrid(b0, 1, b1 - b0, t.grid.stride)
    codes = t.codes[lo // 2 : -(-hi // 2)]
    return replace(t, codes=codes, absmax=t.absmax[b0:b1], shape=(r1 - r0, in_f), grid=grid)


def take_cols(t: NF4Tensor, c0: int, c1: int) -> NF4Tensor:
    """Columns [c0, c1) of a whole 2-D weight (a row-parallel slice): each row's piece must
    be whole blocks, so the width and both ends are multiples of 64."""
    out_f, in_f = t.shape
    if in_f % BLOCK or c0 % BLOCK or c1 % BLOCK or t.grid.rows != 1 or t.grid.first:
        raise ValueError(f"columns [{c0}, {c1}) of a {out_f}x{in_f} weight cut a block of {BLOCK}")
    per_row = in_f // BLOCK
    codes = t.codes.view(out_f, in_f // 2)[:, c0 // 2 : c1 // 2].reshape(-1)
    absmax = t.absmax.view(out_f, per_row)[:, c0 // BLOCK : c1 // BLOCK].reshape(-1)
    grid = BlockGrid(c0 // BLOCK, out_f, (c1 - c0) // BLOCK, per_row)
    return replace(t, codes=codes, absmax=absmax, shape=(out_f, c1 - c0), grid=grid)


def whole_blocks(shape: tuple[int, int], split_dim: int, tp: int) -> bool:
    """Whether splitting a (out, in) weight tp ways along `split_dim` leaves each rank whole
    64-blocks (`take_rows`, `take_cols`)."""
    out_f, in_f = shape
    if split_dim == 0:
        return (out_f // tp * in_f) % BLOCK == 0
    return in_f % BLOCK == 0 and (in_f // tp) % BLOCK == 0


def held_bytes(local: int, whole: int) -> int:
    """Bytes held of a weight of `whole` elements by a rank keeping `local` of them (whole
    blocks): codes, absmax codes, and the whole weight's nested scales and offset."""
    blocks = -(-whole // BLOCK)
    return -(-local // 2) + -(-local // BLOCK) + 4 * -(-blocks // NESTED_BLOCK) + 4


def bits_per_weight() -> float:
    """4 bits of code, 8 of absmax per 64, 32 of nested scale per 64 * 256: 4.127."""
    return 4 + 8 / BLOCK + 32 / (BLOCK * NESTED_BLOCK)
