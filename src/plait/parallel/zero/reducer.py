"""Gradient accumulation and reduction over the data-parallel axis, for every ZeRO stage.

A post-accumulate-grad hook adds each fresh gradient into its group's full-size bucket
(in the reduction dtype) and frees `p.grad`, as data parallelism does. When a bucket has
all its gradients, it launches its collective asynchronously, in group order, while
autograd goes on with earlier layers. What is launched and what is kept differ by stage:

  stage 0: all-reduce the bucket; the whole bucket is the optimizer's gradient.
  stage 1: reduce-scatter the bucket in place; only this rank's slice of it is read.
           The full bucket stays allocated (ZeRO-1 shards optimizer states only).
  stage 2/3: buckets are transient communication buffers: reduce-scatter, add the result
           into a persistent shard-sized gradient, free the bucket. At most `max_inflight`
           buckets are alive at once, so gradient memory is Ψ/N plus a few buckets.

Stages 0-1 communicate once per optimizer step (after the last micro-batch; earlier ones
only accumulate into the full buckets). Stages 2-3 keep no full gradient between
micro-batches, so they reduce-scatter after every micro-batch: k times Ψ per step with k
micro-batches (DeepSpeed's ZeRO-2 does the same). Under a pipeline (`once_per_step`) stages
2-3 reduce like stage 1 instead: the buckets are allocated at a chunk's first gradient and
hold its full gradient through the step's micro-batches, then are reduce-scattered once,
after the chunk's last backward (W under zb-h1), and freed (torchtitan's default with
pipelines): a pipeline runs many micro-batches per step, so per-micro-batch traffic would
multiply by m, while the full gradient of one stage is only 1/pp of the model's.

Each bucket is divided by N before the sum (the gradient of the global mean loss).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.comm import Comm, Handle
from plait.memory_tracker import MemoryTracker
from plait.parallel.zero.layout import MAX_INFLIGHT_BUCKETS, FlatGroup


class GradReducer:
    """Owns the gradient buckets and shards; fires `on_group_done(i)` when group i's last
    gradient of a backward has arrived (stage 3 frees the gathered parameters then)."""

    def __init__(
        self,
        groups: list[FlatGroup],
        comm: Comm,
        axis: str,
        stage: int,
        dtype: torch.dtype,
        device: torch.device,
        tracker: MemoryTracker,
        on_group_done: Callable[[int], None] | None = None,
        max_inflight: int = MAX_INFLIGHT_BUCKETS,
        once_per_step: bool = False,
    ) -> None:
        """`once_per_step`: stages 2-3 accumulate the full gradient over the micro-batches
        and reduce-scatter it once per step (pipelines); stages 0-1 always do."""
        self.groups, self.comm, self.axis, self.stage = groups, comm, axis, stage
        self.per_micro_batch = stage >= 2 and not once_per_step
        self.dtype, self.device, self.tracker = dtype, device, tracker
        self.on_group_done = on_group_done
        self.max_inflight = max_inflight
        self.n = comm.mesh.size(axis)
        self.full: list[Tensor | None] = []
        self.shards: list[Tensor] = []
        for g in groups:
            if stage <= 1:
                full = torch.zeros(g.padded, dtype=dtype, device=device)
                tracker.track(f"grads:{g.index}", "gradients", full)
                self.full.append(full)
                self.shards.append(full[g.lo : g.hi])
            else:
                shard = torch.zeros(g.shard_numel, dtype=dtype, device=device)
                tracker.track(f"grads:{g.index}", "gradients", shard)
                self.full.append(None)
                self.shards.append(shard)
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}
        self._view: dict[nn.Parameter, Tensor] = {}  # stages 0-1: p's slot in its bucket
        for g in groups:
            for p, off in zip(g.params, g.offsets, strict=True):
                self._slot[p] = (g.index, off)
                if stage <= 1:
                    self._view[p] = self.full[g.index][off : off + p.numel()].view_as(p)
        self.sync = True
        self._dirty = False  # a gradient arrived since the last reset
        self._pending = [len(g.params) for g in groups]
        self._next = 0
        self._inflight: deque[tuple[int, Handle]] = deque()
        self.launch_log: list[tuple[int, str]] = []  # (group, 'backward'|'flush'), last round
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._slot]

    # -- protocol ----------------------------------------------------------------------
    def micro_batch(self, is_last: bool) -> None:
        """Before each micro-batch's backward; stages 0-1 (and 2-3 once per step) communicate
        after the last only."""
        if self.per_micro_batch:
            self._flush()
        self.sync = is_last or self.per_micro_batch

    def finish(self) -> None:
        """Every reduction launched and complete; the shards hold the averaged gradient.

        Also when no micro-batch was marked last: what arrived is reduced all the same."""
        self.sync = True
        self._flush()

    @torch.no_grad()
    def zero_grad(self) -> None:
        # Stages 0-1: the shards are views of the full buckets, zeroed with them.
        for buffer in self.full if self.stage <= 1 else self.shards:
            buffer.zero_()
        for p in self._slot:
            p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- internals ---------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        """Runs once per parameter per backward (autograd calls hooks without grad mode):
        kept to a dict lookup and one add where the bucket is persistent."""
        gi, off = self._slot[p]
        view = self._view.get(p)
        if view is not None:
            view.add_(p.grad)
        else:
            self._bucket(gi)[off : off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None  # the bucket holds it now
        self._dirty = True
        if self.sync:
            self._pending[gi] -= 1
            if self._pending[gi] == 0:
                if self.on_group_done is not None:
                    self.on_group_done(gi)
                self._launch(force=False)

    def _bucket(self, gi: int) -> Tensor:
        """Group gi's full bucket, allocated (zeroed) on first use in stages 2-3."""
        full = self.full[gi]
        if full is None:
            full = torch.zeros(self.groups[gi].padded, dtype=self.dtype, device=self.device)
            self.full[gi] = full
            self.tracker.track(f"bucket:{gi}", "comm_buffers", full, transient=True)
        return full

    def _launch(self, force: bool) -> None:
        """Launch complete buckets strictly in group order (all ranks issue the same calls)."""
        while self._next < len(self.groups):
            gi = self._next
            if self._pending[gi] > 0 and not force:
                return
            if self._next == 0:
                self.launch_log = []
            if self._pending[gi] > 0 and self.on_group_done is not None:
                self.on_group_done(gi)  # some parameter got no gradient: done all the same
            g, full = self.groups[gi], self._bucket(gi)
            if self.n > 1:
                full.div_(self.n)  # before the sum, while backward still runs
            if self.stage == 0:
                handle = self.comm.all_reduce(full, self.axis, tag="grad", async_op=True)
            else:
                out = full[g.lo : g.hi]  # in place: NCCL and gloo accept this aliasing
                handle = self.comm.reduce_scatter(out, full, self.axis, tag="grad", async_op=True)
            self._inflight.append((gi, handle))
            self.launch_log.append((gi, "flush" if force else "backward"))
            self._next += 1
            if self.stage >= 2:
                while len(self._inflight) > self.max_inflight:
                    self._complete_oldest()

    @torch.no_grad()
    def _complete_oldest(self) -> None:
        gi, handle = self._inflight.popleft()
        handle.wait()
        if self.stage >= 2:  # accumulate the reduced shard, free the bucket
            g, full = self.groups[gi], self.full[gi]
            self.shards[gi].add_(full[g.lo : g.hi])
            self.full[gi] = None
            self.tracker.release(f"bucket:{gi}")

    def _flush(self) -> None:
        """Launch what is left of this round (unused parameters), wait for everything."""
        if self._dirty and self.sync:
            self._launch(force=True)
        while self._inflight:
            self._complete_oldest()
        if self.sync:
            self._pending = [len(g.params) for g in self.groups]
            self._next = 0
            self._dirty = False
