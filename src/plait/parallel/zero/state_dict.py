"""The sharded optimizer state expressed per parameter, independent of the layout.

A rank's shard of a flat group covers pieces of parameters (see layout.ShardPiece). Each piece
is reported with the parameter's name and shape and the range of its flattened elements
that this rank holds; padding is never included. Concatenating every rank's pieces of a
parameter in `start` order gives its full state, whatever world size or bucket size the
run used, so a checkpoint written under one layout can be loaded under another
(`import_states` slices full per-parameter states back into any layout's shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.parallel.zero.layout import FlatGroup


@dataclass
class ParamShardState:
    """Optimizer state of elements [start, start + length) of one flattened parameter."""

    name: str
    shape: tuple[int, ...]  # the parameter's shape on this rank (before ZeRO sharding)
    start: int
    length: int
    tensors: dict[str, Tensor]  # master and the optimizer's states: fp32, (length,)


def export_states(groups: list[FlatGroup], states) -> list[ParamShardState]:
    """Every piece of every group's shard, read from `states` (resident or NVMe)."""
    out = []
    for g in groups:
        values = states.read(g.index, 0, g.shard_numel)
        for piece in g.pieces():
            lo, hi = piece.shard_offset, piece.shard_offset + piece.length
            p = g.params[piece.param]
            tensors = {k: v[lo:hi].clone() for k, v in values.items()}
            out.append(
                ParamShardState(
                    g.names[piece.param], tuple(p.shape), piece.start, piece.length, tensors
                )
            )
    return out


def assemble(pieces: list[ParamShardState]) -> dict[str, dict[str, Tensor]]:
    """Full per-parameter states (name -> state -> tensor of the parameter's shape) from the
    pieces of all ranks; raises if some element is missing or held twice."""
    by_name: dict[str, list[ParamShardState]] = {}
    for s in pieces:
        by_name.setdefault(s.name, []).append(s)
    out = {}
    for name, parts in by_name.items():
        parts.sort(key=lambda s: s.start)
        shape = parts[0].shape
        covered = 0
        for s in parts:
            if s.start != covered:
                raise ValueError(
                    f"state of {name!r}: elements from {covered} to {s.start} missing or held twice"
                )
            covered += s.length
        if covered != torch.Size(shape).numel():
            raise ValueError(f"state of {name!r} covers {covered} of {torch.Size(shape).numel()}")
        out[name] = {
            k: torch.cat([s.tensors[k] for s in parts]).view(shape) for k in parts[0].tensors
        }
    return out


def import_states(groups: list[FlatGroup], states, full: dict[str, dict[str, Tensor]]) -> None:
    """Write this rank's pieces of `full` (as `assemble` returns) into `states`."""
    for g in groups:
        values = states.read(g.index, 0, g.shard_numel)  # keeps padding as it is (zero)
        for piece in g.pieces():
            name = g.names[piece.param]
            if name not in full:
                raise KeyError(f"no optimizer state for parameter {name!r} in the loaded state")
            lo = piece.shard_offset
            for k in states.names:
                src = full[name][k].reshape(-1)[piece.start : piece.start + piece.length]
                values[k][lo : lo + piece.length].copy_(src)
        states.write(g.index, 0, values)
