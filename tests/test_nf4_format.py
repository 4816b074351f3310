"""plait's NF4 (models/nf4/format.py) is bitsandbytes' format, byte for byte and bit for bit.

Compared with bitsandbytes 0.50 on CPU (quantize_4bit / dequantize_4bit, blocksize 64, nf4,
compress_statistics=True), over shapes with and without a short last block, odd sizes, an
all-zero block, and fp32 / bf16 / fp16 weights:

- the 4-bit codes equal `quantize_4bit`'s byte for byte; the offset and the nested fp32
  scales are equal; the NF4 and dynamic tables are bitsandbytes' to the bit;
- the 8-bit absmax codes equal bitsandbytes' plain-PyTorch reference op (backends/default:
  the exact nearest code, a tie to the lower). Its compiled CPU kernel looks codes up in a
  table of 65536 bins instead, so near a midpoint between two codes it may pick the other
  one: where it does, the two codes are neighbours and the value lies within one bin (2/65535
  of the scale) of their midpoint; both are the format, and each side dequantizes the
  other's codes to the same bits;
- dequantized weights equal bitsandbytes' bit for bit, in fp32, bf16 and fp16: plait's
  dequantization of bitsandbytes' own quantized state, and bitsandbytes' dequantization of
  plait's. (bitsandbytes' compiled CPU kernel reads a weight whose rows are not whole blocks,
  in_features % 64 != 0, with the wrong scales; there the reference op is compared.)
- tensor-parallel slices dequantize to exactly their part of the whole weight.
"""

from __future__ import annotations

import logging

import pytest
import torch

from plait.models.nf4.format import (
    BlockGrid,
    NF4Tensor,
    bits_per_weight,
    dequantize,
    dynamic_map,
    nf4_table,
    quantize,
    take_cols,
    take_rows,
)

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a missing optional CPU kernel
bnb = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(128, 64), (64, 192), (300, 64), (256, 320), (64, 96), (7, 9), (33, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# bitsandbytes' reference kernels (backends/default/ops.py): registered for torch's
# CompositeExplicitAutograd key, which the CPU kernel overrides; called by that key.
REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def weight(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02 * (1 + seed % 7)
    w.view(-1)[64:128] = 0  # an all-zero block (where the shape has one)
    return w.to(dtype)


def state_of(t: NF4Tensor, dtype: torch.dtype):
    """bitsandbytes' QuantState for plait's tensor (whole weights)."""
    nested = bnb.QuantState(absmax=t.nested, code=bnb.create_dynamic_map(), blocksize=256,
                            dtype=torch.float32)  # fmt: skip
    return bnb.QuantState(absmax=t.absmax, shape=torch.Size(t.shape), dtype=dtype, blocksize=64,
                          code=bnb.get_4bit_type("nf4", "cpu"), quant_type="nf4",
                          offset=t.offset, state2=nested)  # fmt: skip


def test_tables_are_bitsandbytes() -> None:
    assert torch.equal(nf4_table(), bnb.get_4bit_type("nf4", "cpu"))
    assert torch.equal(dynamic_map(), bnb.create_dynamic_map())
    assert bits_per_weight() == pytest.approx(4.127, abs=5e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codes_and_constants(shape, dtype) -> None:
    w = weight(shape, dtype, seed=sum(shape))
    ours = quantize(w)
    codes, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(ours.codes, codes.reshape(-1))  # byte for byte
    assert torch.equal(ours.offset, state.offset)
    blocks = -(-w.numel() // 64)
    assert ours.absmax.shape == (blocks,) and ours.nested.shape == (-(-blocks // 256),)
    assert ours.nbytes == w.numel() // 2 + w.numel() % 2 + blocks + 4 * ours.nested.numel() + 4
    assert ours.dtype == dtype and ours.shape == shape
    # the absmax codes: the reference op's exactly, ...
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    raw = block_absmax(w) - ours.offset
    ref_codes, ref_scale = op.redispatch(REFERENCE, raw, bnb.create_dynamic_map(), 256)
    assert torch.equal(ours.absmax, ref_codes) and torch.equal(ours.nested, ref_scale)
    # ... and the compiled CPU kernel's but at its table's near-ties. (A weight of one block
    # has absmax - mean = 0: the reference stores its scale as 1e-38, the kernel as 0, and
    # either code; both dequantize to the offset.)
    assert torch.equal(ours.nested.clamp(min=1e-38), state.state2.absmax.clamp(min=1e-38))
    differ = (ours.absmax != state.absmax).nonzero().reshape(-1)
    table = dynamic_map()
    for i in differ.tolist():
        if ours.nested[i // 256] <= 1e-38:
            continue
        a, b = sorted((int(ours.absmax[i]), int(state.absmax[i])))
        assert b == a + 1, (i, a, b)
        scaled = raw[i] / ours.nested[i // 256]
        assert abs(scaled - (table[a] + table[b]) / 2) <= 2 / 65535, (i, scaled)


def block_absmax(w: torch.Tensor) -> torch.Tensor:
    flat = w.reshape(-1).float()
    full = flat.numel() - flat.numel() % 64
    out = flat[:full].reshape(-1, 64).abs().max(dim=-1).values
    return torch.cat([out, flat[full:].abs().max().reshape(1)]) if full < flat.numel() else out


@pytest.mark.parametrize("shape", [(300, 64), (256, 320), (64, 96)], ids=str)
def test_dequantized_bit_for_bit(shape) -> None:
    w = weight(shape, torch.float32, seed=7 * sum(shape))
    ours = quantize(w)
    codes, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    theirs = ours.with_tensors((codes.reshape(-1), state.absmax, state.state2.absmax,
                                state.offset))  # fmt: skip
    rows_whole = shape[-1] % 64 == 0
    op = torch.ops.bitsandbytes.dequantize_4bit.default
    for dtype in DTYPES:
        for t in (ours, theirs):
            st = state_of(t, dtype)
            if rows_whole:
                assert torch.equal(dequantize(t, dtype), bnb.dequantize_4bit(codes_of(t), st))
                continue
            scales = bnb.dequantize_blockwise(t.absmax, st.state2) + t.offset
            ref = op.redispatch(REFERENCE, codes_of(t), scales, 64, "nf4", list(shape), dtype)
            assert torch.equal(dequantize(t, dtype), ref)
    # the values are the weight's, to the format's resolution (the largest NF4 gap / 2)
    err = (dequantize(ours) - w).abs().max() / w.abs().max()
    assert 0 < err < 0.17


def codes_of(t: NF4Tensor) -> torch.Tensor:
    return t.codes.reshape(-1, 1)


def test_slices_are_their_part_of_the_whole() -> None:
    """Slices cut on block boundaries carry the whole weight's nested scales and offset, so
    each dequantizes to exactly its part: rows (column-parallel), columns (row-parallel)."""
    w = weight((96, 384), torch.float32, seed=3)  # 576 blocks: three nested blocks
    whole = quantize(w)
    full = dequantize(whole)
    for r0, r1 in ((0, 48), (48, 96), (32, 64)):
        part = take_rows(whole, r0, r1)
        assert part.grid == BlockGrid(r0 * 6, 1, (r1 - r0) * 6, 576)
        assert torch.equal(dequantize(part), full[r0:r1])
    for c0, c1 in ((0, 192), (192, 384), (64, 128)):
        part = take_cols(whole, c0, c1)
        assert part.codes.numel() == 96 * (c1 - c0) // 2
        assert torch.equal(dequantize(part), full[:, c0:c1])
    with pytest.raises(ValueError, match=r"rows \[0, 3\) of a 96x96 weight"):
        take_rows(quantize(w[:, :96]), 0, 3)  # 288 weights: not whole blocks
    with pytest.raises(ValueError, match=r"columns \[0, 32\) of a 96x384 weight"):
        take_cols(whole, 0, 32)
