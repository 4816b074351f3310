"""Column vs row split, measured: what one Linear of the lesson model's MLP communicates when
split each way, alone and in the pairs a block could use.

Each arrangement is built from plait's own tp layers at the MLP's shapes (h -> ffn -> h), run
forward and backward once on the world's tp ranks with a fresh `Comm`, and its collectives
counted per phase:

    column      fc1 split by output features: f before it (identity forward, all-reduce of
                the input gradient backward)
    row         fc2 split by input features: g after it (all-reduce of the partial sums
                forward, identity backward)
    paired      column -> GELU -> row, as Megatron splits the MLP: the column's output slice
                is the row's input slice, so the block communicates once each way
    unpaired    column with its output gathered -> GELU -> row re-splitting its input: what
                a block pays without the pairing (two all-gathers of b·s·ffn more)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.lessons.phases import as_rows, snapshot
from plait.mesh import Mesh
from plait.models.architecture import ModelConfig
from plait.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

ARRANGEMENTS = ("column", "row", "paired", "unpaired")


def _filled(layer: nn.Module, seed: int) -> nn.Module:
    """Small random weights, the same on every rank (the counts do not depend on them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return layer


def _build(name: str, h: int, ffn: int, comm: Comm) -> Callable[[Tensor], Tensor]:
    """The forward of arrangement `name` (input (b, s, h), or (b, s, ffn/t) for `row`)."""
    if name == "row":
        return _filled(RowParallelLinear(ffn, h, comm), 2)  # (b, s, ffn/t) -> (b, s, h)
    col = _filled(ColumnParallelLinear(h, ffn, comm, gather_output=name == "unpaired"), 1)
    if name == "column":
        return col  # (b, s, h) -> (b, s, ffn/t)
    row = _filled(RowParallelLinear(ffn, h, comm, input_is_parallel=name == "paired"), 2)
    return lambda x: row(F.gelu(col(x)))  # (b, s, h) -> (b, s, ffn/t or ffn) -> (b, s, h)


def measure_split(arch: ModelConfig, b: int, s: int, mesh: Mesh) -> dict[str, dict]:
    """{arrangement: {"forward": rows, "backward": rows}} for one (b, s) micro-batch."""
    comm = Comm(mesh)  # its own counts, apart from the training run's
    h, ffn, t = arch.d_model, arch.ffn_dim, mesh.size("tp")
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in ARRANGEMENTS:
        width = ffn // t if name == "row" else h
        x = torch.randn(b, s, width, generator=gen).requires_grad_()
        forward = _build(name, h, ffn, comm)
        comm.stats.begin_step(0)
        y = forward(x)
        fwd = snapshot(comm.stats)
        comm.stats.begin_step(1)
        y.backward(torch.ones_like(y))
        out[name] = {"forward": as_rows(fwd), "backward": as_rows(snapshot(comm.stats))}
    return out
