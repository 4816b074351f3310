"""The two weight versions of PipeDream-2BW on one rank, and the delayed update between them.

Version j lives in copy j % 2 of this rank's (pruned) model. In-flight micro-batches run on
the copy holding their version, so their autograd graphs save that copy's own parameter
tensors and their gradients accumulate on them; nothing is swapped in or out of a module
while a graph depends on it. Activation recomputation works unchanged, since a recomputed
forward runs the same copy again.

The update of step k (W(k+1) = W(k) - lr·AdamW(g_k), g_k computed at W(k-1)) writes into the
copy that held W(k-1), free by then: first W(k) is copied there, then a single AdamW steps it.
The optimizer's state must carry over from step to step while its target alternates between
the two copies, so the optimizer owns *shell* parameters: one nn.Parameter per parameter,
holding no memory of its own, pointed (`.data`) at the target copy's storage right before the
step. A shell has its own autograd version counter, and the target copy has no live graph
(checked), so the in-place step can never corrupt a saved tensor of an in-flight micro-batch.
Two copies plus moments: the paper's 2W + optimizer state, no third weight copy.

Under tensor parallelism each copy holds this rank's shards; the copy shares the original's
`Comm` (deep-copying it would copy process groups), and the update adds the tp bookkeeping of
`tp/grads.py`: sequence-parallel partial gradients are summed over tp, and the norm sums
shards' squares over tp while counting replicated parameters once.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.config import Config
from plait.models.transformer import Transformer
from plait.optim import build_optimizer, scale_to_norm, set_lr
from plait.parallel.pipeline.stage import tied_embedding_params
from plait.parallel.recompute import apply_recompute
from plait.parallel.tp.grads import grad_norm_groups, sequence_parallel_partial_params


def weights_of(step: int) -> int:
    """The weight version step `step`'s micro-batches run with: max(step - 1, 0)."""
    return max(step - 1, 0)


class WeightVersions:
    """Two copies of this rank's stages and the optimizer that steps between them."""

    def __init__(self, model: Transformer, cfg: Config, comm: Comm, is_last: bool) -> None:
        self.cfg, self.comm = cfg, comm
        # Copy before recompute: its wrappers close over the module they wrap. The copy's tp
        # layers keep using the same Comm (memo), not a copy of its process groups.
        self.copies = [model, copy.deepcopy(model, memo={id(comm): comm})]
        for c in self.copies:
            apply_recompute(c, cfg.parallel.recompute)
            c.train()
        self.params = [list(c.parameters()) for c in self.copies]
        self.held = [0, None]  # the version each copy holds (copy 1 holds nothing yet)
        self.latest = 0
        self.shells = nn.ParameterList(
            nn.Parameter(torch.empty((0,) * p.dim(), dtype=p.dtype, device=p.device))
            for p in self.params[0]
        )
        self.optimizer = build_optimizer(self.shells, cfg.train)
        tied = {id(p) for p in tied_embedding_params(model)}
        self.tied = [i for i, p in enumerate(self.params[0]) if id(p) in tied]
        sharded = {id(p) for p in grad_norm_groups(model)[0]}
        self.sharded = {i for i, p in enumerate(self.params[0]) if id(p) in sharded}
        partial = {id(p) for p in sequence_parallel_partial_params(model)}
        self.partial = [i for i, p in enumerate(self.params[0]) if id(p) in partial]
        # The last stage's copy of a tied embedding is counted once, by the first stage.
        skip = comm.mesh.size("pp_ends") > 1 and is_last
        self.norm_skip = set(self.tied[-1:]) if skip else set()

    def model(self, version: int) -> Transformer:
        """The copy that holds `version` (raises if it has been overwritten or not made yet)."""
        c = version % 2
        if self.held[c] != version:
            raise RuntimeError(f"weight version {version} is not held (copies: {self.held})")
        return self.copies[c]

    @property
    def latest_model(self) -> Transformer:
        return self.model(self.latest)

    def seal(self, step: int) -> list[Tensor]:
        """Take step `step`'s accumulated gradients off its copy, so the next step starts at
        zero; every backward of the step on this rank is done (STEP follows them)."""
        grads = []
        for p in self.params[weights_of(step) % 2]:
            grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
            p.grad = None
        return grads

    # -- the delayed update ----------------------------------------------------------------
    def update(
        self, step: int, grads: list[Tensor], loss_sum: Tensor, lr: float, busy: set[int]
    ) -> tuple[float, float]:
        """Produce version step+1 from version step and the step's gradients.

        Collective over dp, the pipeline ends and pp: call it on every rank at the same update
        point (a consistent cut, see async_2bw_points). `busy`: versions in-flight micro-batches
        use. Returns (global mean loss of the step, gradient norm before clipping).
        """
        if step != self.latest:
            raise RuntimeError(f"update of step {step} but the latest version is {self.latest}")
        target = (step + 1) % 2
        if self.held[target] in busy:
            raise RuntimeError(f"version {self.held[target]} is still in use: cannot replace it")
        loss, norm = self._reduce(grads, loss_sum)
        scale_to_norm(grads, norm, self.cfg.train.grad_clip)
        with torch.no_grad():
            for dst, src in zip(self.params[target], self.params[step % 2], strict=True):
                dst.copy_(src)
        for shell, dst, g in zip(self.shells, self.params[target], grads, strict=True):
            shell.data = dst.data  # same storage, the shell's own version counter
            shell.grad = g
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        for shell in self.shells:
            shell.grad = None
        self.held[target], self.latest = step + 1, step + 1
        return float(loss), float(norm)

    def _reduce(self, grads: list[Tensor], loss_sum: Tensor) -> tuple[Tensor, Tensor]:
        """dp-average the gradients, sum sequence-parallel partials over tp and the tied
        embedding's over the pipeline ends, then one pp all-reduce of (loss, squared norm)
        and a dp average of the loss."""
        comm, m = self.comm, self.cfg.accumulation
        comm.all_reduce_flat(grads, "dp", op="avg", tag="grad")
        comm.all_reduce_flat([grads[i] for i in self.partial], "tp", tag="tp-sp-grads")
        for i in self.tied:
            comm.all_reduce(grads[i], "pp_ends", op="sum", tag="tied_embedding")
        stats = torch.zeros(2, device=comm.mesh.device)
        stats[0] = loss_sum / m  # nonzero on the last stage only (the same on every tp rank)
        shard_sq = torch.zeros((), device=comm.mesh.device)
        for i, g in enumerate(grads):
            if i in self.norm_skip:
                continue
            if i in self.sharded:
                shard_sq += g.float().pow(2).sum()
            else:
                stats[1] += g.float().pow(2).sum()  # replicated over tp: counted once
        if comm.mesh.size("tp") > 1:
            comm.all_reduce(shard_sq, "tp", op="sum", tag="grad_norm")
        stats[1] += shard_sq
        comm.all_reduce(stats, "pp", op="sum", tag="loss_and_grad_norm")
        comm.all_reduce(stats, "dp", op="avg", tag="loss")  # norms agree across dp already
        return stats[0], stats[1].sqrt()

    def storages(self) -> int:
        """Distinct parameter storages on this rank (shells alias the copies): measured memory."""
        ptrs = {p.untyped_storage().data_ptr() for ps in self.params for p in ps}
        ptrs |= {s.untyped_storage().data_ptr() for s in self.shells if s.numel()}
        return len(ptrs)
