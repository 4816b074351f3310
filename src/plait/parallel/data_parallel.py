"""Data parallelism (ZeRO stage 0): bucketed gradient all-reduce overlapped with backward.

How it works, in the order things happen during one optimizer step:
1. Each micro-batch's backward fires a post-accumulate-grad hook per parameter. The hook adds
   the fresh gradient into the parameter's slot in a flat bucket and frees `p.grad`.
2. On the last micro-batch only (gradient accumulation communicates once per step), a bucket
   whose every gradient has arrived launches an asynchronous all-reduce right away, while
   autograd keeps computing earlier layers' gradients: that is the overlap. Buckets launch
   strictly in index order, so every rank issues the same collectives in the same order.
3. `finish()` launches any bucket still waiting (unused parameters), waits for all of them,
   and points each `p.grad` at its averaged view for the optimizer.

Averaging: each rank's gradient is that of its mean loss; the sum over dp divided by dp is
the gradient of the global batch's mean loss, which is what a single process computes.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm import Comm
from plait.parallel.buckets import Bucket, build_buckets


class DataParallel:
    """Owns the gradient buckets of a model replica and reduces them over the `dp` axis."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        bucket_mb: float = 25.0,
        axis: str = "dp",
        pad_multiple: int = 1,
    ) -> None:
        self.comm = comm
        self.axis = axis
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = build_buckets(self.params, int(bucket_mb * 2**20), None, pad_multiple)
        self._slot: dict[nn.Parameter, tuple[Bucket, torch.Tensor]] = {}
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                self._slot[p] = (bucket, view)
        self.sync = True
        self._stale = False
        self.launch_log: list[tuple[int, str]] = []  # (bucket, 'backward'|'finish'), last step
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._reset_pending()

    # -- the step protocol -------------------------------------------------------------
    def micro_batch(self, is_last: bool) -> None:
        """Call before each micro-batch's backward: communicate only after the last one."""
        self.sync = is_last

    def finish(self) -> None:
        """Complete every reduction and expose the averaged gradients as `p.grad`."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            bucket.handle.wait()
        for p in self.params:
            p.grad = self._slot[p][1]
        self._reset_pending()
        self._stale = True

    def zero_grad(self, keep: nn.Parameter | None = None) -> None:
        """Zero the buckets and detach `p.grad`, so the next backward starts from zero.

        Also done automatically at the first gradient after `finish()`, so the usual
        `optimizer.zero_grad()` is enough (it sets every `p.grad` to None).
        """
        for bucket in self.buckets:
            bucket.buffer.zero_()
        for p in self.params:
            if p is not keep:
                p.grad = None
        self._stale = False

    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat buffers (for norms and clipping without touching each parameter)."""
        return [b.buffer for b in self.buckets]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- internals --------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if self._stale:  # first gradient since finish(): the buckets still hold the last step's
            self.zero_grad(keep=p)
        bucket, view = self._slot[p]
        view.add_(p.grad)
        p.grad = None  # the bucket holds it now; free the per-parameter copy
        if self.sync:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not force:
                return
            if self._next_launch == 0:
                self.launch_log = []
            # Divide before the sum, while backward still runs, rather than after the wait.
            if (n := self.comm.mesh.size(self.axis)) > 1:
                bucket.buffer.div_(n)
            bucket.handle = self.comm.all_reduce(
                bucket.buffer, self.axis, op="sum", tag="grad", async_op=True
            )
            bucket.launched = True
            self.launch_log.append((bucket.index, "finish" if force else "backward"))
            self._next_launch += 1

    def _reset_pending(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.handle = None
        self._next_launch = 0
