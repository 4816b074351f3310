"""One home for the gradient rules of a split model, and for the exact global gradient norm.

Tensor and pipeline parallelism split the model so that, after the data-parallel reduction,
three things still separate a rank's gradients from the single process's. Every gradient
owner (the ZeRO engine at any stage, the 2BW weight versions, a bare tp model in a test)
hands its gradients here as pieces, `(parameter, view of its gradient or of part of it)`,
and this module applies the rules. Which parameter each rule touches is read from the
model's contract (models/contract.py), never from the model's attributes:

1. Sequence parallelism: a parameter replicated over tp (norm gains, row-parallel biases)
   sees on each tp rank only its sequence shard's gradient; the true gradient is the sum
   over tp (Korthikanti et al., 2022). The contract declares them (`sp_partial`), and LoRA's
   A beside a column-parallel weight, partial with or without SP (`tp_partial`).
2. Tied embeddings under pipeline parallelism: the first and last stage each hold a copy of
   the embedding matrix; their gradients are summed over the pipeline ends ('pp_ends').
3. The global norm counts every parameter once: tp shards (the contract's `shard`) are
   summed over tp, tp-replicated parameters are counted on tp rank 0 only, pipeline stages
   are summed over pp, and the last stage's tied copy is skipped (the first stage counts
   the matrix).

Both sums are linear, so they commute with the data-parallel average and work on dp shards
(ZeRO stage >= 1) as on full gradients: the tp ranks of one dp rank lay their flat groups
out identically, and each tied copy sits alone in its group, so the pieces line up.

The norm does not depend on how gradients are chunked into buckets or shards: each part is
normed in float32 over chunks of `NORM_CHUNK` elements and the squares are summed in float64.
One float32 reduction over a whole 25 MiB bucket drifts by 1e-5 relative or more; over 1024
elements the error is ~1e-9, so a 25 MiB bucket, a tiny bucket and a dp shard all give the
same norm, at the cost of the same single pass over the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.mesh import Mesh
from plait.models.contract import contract_of

GradPieces = Sequence[tuple[nn.Parameter, Tensor]]
"""(parameter, view of its gradient, or of the part of it this rank holds)."""

NORM_CHUNK = 1024
"""Elements per float32 partial norm; the partial squares are summed in float64."""


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient each tp rank sees only in part, in registration
    order (the same on every tp rank): under sequence parallelism those applied per position
    (`sp_partial`: each rank has its sequence shard's), and LoRA's A beside a column-parallel
    weight (`tp_partial`: each rank's B slice contributes its share)."""
    contract = contract_of(model)
    sp = contract.sequence_parallel
    return [
        p
        for e, p in contract.bind(model)
        if e.decl.trainable and (e.decl.tp_partial or (sp and e.decl.sp_partial))
    ]


def tp_replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every tp rank holds whole (the contract declares no shard for them)."""
    return [p for e, p in contract_of(model).bind(model) if e.decl.shard is None]


def tied_embedding_params(model: nn.Module) -> list[nn.Parameter]:
    """The copies of a tied embedding this rank holds as separate parameters: the token
    embedding (first stage) and the head (last stage); one parameter when both ends are
    this rank's, none when untied or neither end is here."""
    contract = contract_of(model)
    return [p for e, p in contract.bind(model) if contract.tied(e)]


def param_grads(model: nn.Module) -> list[tuple[nn.Parameter, Tensor]]:
    """The pieces of a model whose gradients live in `p.grad` (no sharded owner)."""
    return [(p, p.grad) for p in model.parameters() if p.grad is not None]


@dataclass(frozen=True)
class SplitGradRules:
    """Which of this rank's parameters each rule touches, found once from the split model."""

    partial: frozenset[int]  # ids: partial gradients over tp (SP; LoRA A), summed over tp
    tied: frozenset[int]  # ids: tied embedding copies (summed over the pipeline ends)
    uncounted: frozenset[int]  # ids: another rank counts them in the global norm
    tp: int
    pp: int

    @classmethod
    def of(cls, model: nn.Module, mesh: Mesh) -> SplitGradRules:
        tp, pp = mesh.size("tp"), mesh.size("pp")
        tied = tied_embedding_params(model) if pp > 1 else []
        uncounted: set[int] = set()
        if tp > 1 and mesh.axis_rank("tp") != 0:
            uncounted |= {id(p) for p in tp_replicated_params(model)}
        if tied and mesh.axis_rank("pp") == pp - 1 and mesh.size("pp_ends") > 1:
            uncounted.add(id(tied[-1]))  # the last stage's copy: the first stage counts it
        partial = tp_partial_params(model) if tp > 1 else []
        return cls(
            frozenset(id(p) for p in partial),
            frozenset(id(p) for p in tied),
            frozenset(uncounted),
            tp,
            pp,
        )

    @torch.no_grad()
    def sync(self, pieces: GradPieces, comm: Comm) -> None:
        """Rules 1 and 2: sum partial gradients over tp and tied copies over the pipeline
        ends, in place (one flat all-reduce each; nothing when the model is not split)."""
        if self.partial:
            partial = [v for p, v in pieces if id(p) in self.partial]
            comm.all_reduce_flat(partial, "tp", tag="tp-sp-grads")
        if self.tied:
            tied = [v for p, v in pieces if id(p) in self.tied]
            comm.all_reduce_flat(tied, "pp_ends", tag="tied_embedding")

    @torch.no_grad()
    def norm(
        self,
        pieces: GradPieces,
        comm: Comm,
        sharded_over: str | None = None,
        buffers: Sequence[Tensor] | None = None,
        scale: float = 1.0,
    ) -> Tensor:
        """Rule 3: the global L2 norm of the whole model's gradient, float64, on every rank.

        `sharded_over`: the axis over which the pieces are disjoint shards (ZeRO stage >= 1:
        'dp'); `buffers`: flat buffers holding exactly the pieces, normed whole when no piece
        is skipped (fewer kernels; zero padding adds nothing); `scale`: the gradients' loss
        scale (fp16), divided out of the result."""
        if buffers is not None and not self.uncounted:
            parts = list(buffers)
        else:
            parts = [v for p, v in pieces if id(p) not in self.uncounted]
        sq = squared_norm(parts, comm.mesh.device)
        for axis in (sharded_over, "tp" if self.tp > 1 else None, "pp" if self.pp > 1 else None):
            if axis is not None:
                comm.all_reduce(sq, axis, tag="grad_norm")
        return sq.sqrt() / scale


def squared_norm(parts: Sequence[Tensor], device: torch.device) -> Tensor:
    """Sum of squares of `parts` as a float64 scalar, independent of how they are chunked."""
    norms = []
    for t in parts:
        flat = t.reshape(-1)
        dtype = torch.promote_types(flat.dtype, torch.float32)  # 16-bit grads: norm in fp32
        whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
        if whole:
            rows = flat[:whole].view(-1, NORM_CHUNK)
            norms.append(torch.linalg.vector_norm(rows, dim=1, dtype=dtype))
        if whole < flat.numel():
            tail = torch.linalg.vector_norm(flat[whole:], dtype=dtype)
            norms.append(tail.reshape(1))
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.cat(norms).double().square().sum()


def clip_coef(norm: Tensor, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: max_norm / (norm + 1e-6), at most 1; 0 = off."""
    if max_norm <= 0:
        return 1.0
    return float(torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0))
