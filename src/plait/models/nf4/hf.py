"""A Hugging Face folder saved 4-bit (transformers' `load_in_4bit`, bitsandbytes NF4 with
double quantization), read as it is: its codes and constants become `NF4Tensor`s unchanged.

transformers stores each quantized Linear weight as six tensors: `weight` (the packed codes,
uint8 (n/2, 1)), `weight.absmax` (the 8-bit absmax codes), `weight.quant_map` (the 16 NF4
values), `weight.nested_absmax` (fp32, one per 256 blocks), `weight.nested_quant_map` (the
8-bit dynamic map) and `weight.quant_state.bitsandbytes__nf4` (JSON as uint8: quant type,
block size, dtype, shape, nested block size, nested offset). config.json's
`quantization_config` says which scheme made the folder; plait reads this one only and names
any other (fp4, 8-bit, NF4 without double quantization, GPTQ, AWQ) before a worker starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plait.errors import ConfigError
from plait.models.nf4.format import (
    BLOCK,
    NESTED_BLOCK,
    BlockGrid,
    NF4Tensor,
    dequantize,
    dynamic_map,
    nf4_table,
)

STATE = ".quant_state.bitsandbytes__nf4"
"""The suffix of the tensor holding a 4-bit weight's quant state (JSON bytes)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Read = Callable[[str], Tensor]
"""A folder's whole tensor by its Hugging Face name."""


def folder_scheme(hf: Mapping[str, Any], where: str) -> str | None:
    """ "nf4" for a folder bitsandbytes quantized to NF4 with double quantization, None for
    an unquantized one; any other quantization is refused in one line naming it."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "bitsandbytes" and q.get("load_in_4bit"):
        kind, double = q.get("bnb_4bit_quant_type"), q.get("bnb_4bit_use_double_quant")
        if kind == "nf4" and double:
            return "nf4"
        scheme = f"bitsandbytes 4-bit {kind}" + ("" if double else " without double quantization")
    elif method == "bitsandbytes":
        scheme = "bitsandbytes 8-bit (load_in_8bit)" if q.get("load_in_8bit") else "bitsandbytes"
    else:
        scheme = str(method).upper() if isinstance(method, str) else repr(method)
    raise ConfigError(
        f"{where}: quantization_config is {scheme}; plait reads only bitsandbytes NF4 with "
        "double quantization (QLoRA's format) or an unquantized folder"
    )


def is_nf4_folder(folder: Path) -> bool:
    """Whether `folder` (a Hugging Face folder, checked elsewhere) was saved 4-bit in NF4;
    another quantization is refused (`folder_scheme`)."""
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # not this check's to report: reading the folder's config says why
    return isinstance(hf, dict) and folder_scheme(hf, str(path)) == "nf4"


def quant_state(read: Read, name: str) -> dict[str, Any]:
    """The JSON quant state of 4-bit weight `name` (its Hugging Face name)."""
    raw = bytes(read(name + STATE).tolist())
    try:
        state = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{name + STATE!r} is not a readable quant state: {e}") from e
    expected = {"quant_type": "nf4", "blocksize": BLOCK, "nested_blocksize": NESTED_BLOCK}
    for key, want in expected.items():
        if state.get(key) != want:
            raise ConfigError(
                f"{name!r}: quant state {key}={state.get(key)!r}, plait reads {want!r}"
            )
    return state


def quantized_shape(files: Mapping[str, Any], read: Read, name: str) -> tuple[int, ...] | None:
    """The shape a 4-bit weight stands for (its quant state's), or None when `name` is not
    stored 4-bit in the folder whose tensors are `files`."""
    if name + STATE not in files:
        return None
    return tuple(quant_state(read, name)["shape"])


def read_nf4(read: Read, name: str) -> NF4Tensor:
    """Weight `name` of a 4-bit folder as an `NF4Tensor`, its bytes as stored; its maps must
    be bitsandbytes' NF4 and dynamic tables (another table is another format)."""
    state = quant_state(read, name)
    for suffix, table in ((".quant_map", nf4_table()), (".nested_quant_map", dynamic_map())):
        if not torch.equal(read(name + suffix).float(), table):
            raise ConfigError(f"{name + suffix!r} is not bitsandbytes' table; plait cannot read it")
    shape = tuple(state["shape"])
    absmax = read(name + ".absmax").reshape(-1)
    blocks = absmax.numel()
    return NF4Tensor(
        codes=read(name).reshape(-1),
        absmax=absmax,
        nested=read(name + ".nested_absmax").float().reshape(-1),
        offset=torch.tensor(float(state["nested_offset"]), dtype=torch.float32),
        shape=shape,
        dtype=_DTYPES[state["dtype"]],
        grid=BlockGrid(0, 1, blocks, blocks),
    )


def dequantizing(
    files: Mapping[str, Any], whole: Read, read: Callable[[str, tuple[slice, ...]], Tensor]
) -> Callable[[str, tuple[slice, ...]], Tensor]:
    """`read(name, region)` over a folder's tensors, a weight stored 4-bit dequantized to
    fp32 (whole, then the region): a 4-bit folder read as plain weights, the values a QLoRA
    run computes with (`plait eval`/`generate --init-from`, a checkpoint's base)."""

    def region(name: str, where: tuple[slice, ...]) -> Tensor:
        if name + STATE not in files:
            return read(name, where)
        return dequantize(read_nf4(whole, name), torch.float32)[where]

    return region
