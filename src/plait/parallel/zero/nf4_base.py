"""A LoRA run's frozen base held in NF4 (`--base-dtype nf4`, QLoRA): the blocks' Linear
weights as 4-bit codes with double-quantized constants (models/nf4/format.py), 0.52 bytes per
weight instead of 2 (bf16) or 4 (fp32).

Which weights: every frozen 2-D weight of a block (the Linears of attention and the MLP, as
transformers' `load_in_4bit` quantizes them); the embedding, the head, the norms and any bias
stay in the compute dtype (zero/frozen.py holds them). Each weight is quantized once, whole,
from the run's source (`NF4Source`: the seed, a Hugging Face folder, or a 4-bit folder read as
it is), and this rank keeps only its tensor-parallel slice, cut on 64-block boundaries with
the whole weight's nested scales and offset: so a slice dequantizes to exactly its part of
the single process's weight, and every layout computes with the same numbers. Then the
layer computes through `models/nf4/linear.py` and the parameter keeps no storage. (Stage 3
then shards these bytes per block: zero/nf4_shards.py; until it does, each rank holds the
whole quantized base once, one weight's full-precision values at a time.)

Memory tracker: `nf4:NAME` (parameters), the bytes of codes and constants this rank holds;
`nf4-dequantized` (parameters, transient), the one weight dequantized for a product.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.memory_tracker import MemoryTracker
from plait.models.contract import Declared, ShardSpec, contract_of
from plait.models.nf4.format import NF4Source, NF4Tensor, take_cols, take_rows
from plait.models.nf4.linear import HeldNF4, compute_over_nf4, release_storage


def nf4_targets(model: nn.Module) -> list[tuple[Declared, nn.Parameter]]:
    """The frozen 2-D weights of the blocks this rank holds, in registration order."""
    return [
        (entry, p)
        for entry, p in contract_of(model).bind(model)
        if entry.part.kind == "block" and not entry.decl.trainable and len(entry.decl.shape) == 2
    ]


def local_slice(whole: NF4Tensor, shard: ShardSpec | None) -> NF4Tensor:
    """This rank's part of a whole NF4 weight: all of it, its rows (column-parallel) or its
    columns (row-parallel), whole 64-blocks only."""
    if shard is None:
        return whole
    lo, n = shard.offsets[shard.dim], shard.local_shape[shard.dim]
    return (take_rows if shard.dim == 0 else take_cols)(whole, lo, lo + n)


@torch.no_grad()
def hold_nf4(
    model: nn.Module,
    source: NF4Source,
    device: torch.device,
    tracker: MemoryTracker,
    compute: torch.dtype | None = None,
) -> dict[str, HeldNF4]:
    """Quantize (or read) each block Linear weight, keep this rank's slice on `device`, route
    its layer's product through it (in `compute`, None: its input's dtype) and release the
    parameter's storage; name -> held."""
    held: dict[str, HeldNF4] = {}

    def meter(weight: torch.Tensor | None) -> None:
        """The weight dequantized for a product, while it is (models/nf4/linear.py)."""
        if weight is None:
            tracker.release("nf4-dequantized")
        else:
            tracker.track("nf4-dequantized", "parameters", weight, transient=True)

    for entry, param in nf4_targets(model):
        whole = source(entry.name, tuple(entry.decl.shape))
        if whole.shape != tuple(entry.decl.shape):
            raise ValueError(f"{entry.name}: NF4 weight of shape {whole.shape}, "
                             f"the model declares {entry.decl.shape}")  # fmt: skip
        part = local_slice(whole, entry.decl.shard)
        part = part.with_tensors(tuple(t.to(device, copy=True) for t in part.tensors()))
        held[entry.name] = HeldNF4(part, compute, meter)
        compute_over_nf4(model.get_submodule(entry.name.rpartition(".")[0]), held[entry.name])
        release_storage(param)
        tracker.track(f"nf4:{entry.name}", "parameters", part.nbytes)
    return held
