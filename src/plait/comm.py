"""The only module that calls torch.distributed's communication functions.

Every collective goes through `Comm`, which (1) records op, axis, dtype, elements and bytes
into `CommStats` so each step's traffic can be shown next to the theory, and (2) waits with a
deadline, so a stalled collective raises an error naming op, axis and step instead of hanging.

Bytes are *logical* bytes: the size of the full buffer the collective is about (all-reduce:
the buffer; all-gather: the gathered output; reduce-scatter: the input before scattering).
That is the convention of the ZeRO and Megatron papers' formulas; wire bytes of a ring
algorithm are 2(n-1)/n of it for all-reduce and (n-1)/n for the others.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.errors import CommError, CommTimeoutError
from plait.mesh import Mesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class CommRecord:
    """Totals of one kind of call within a step."""

    op: str
    axis: str
    dtype: str
    tag: str
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-step accounting of every call made through a Comm."""

    step: int = 0
    records: dict[tuple[str, str, str, str], CommRecord] = field(default_factory=dict)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.records = {}

    def record(self, op: str, axis: str, tensor: torch.Tensor, tag: str) -> None:
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = (op, axis, dtype, tag)
        rec = self.records.setdefault(key, CommRecord(op, axis, dtype, tag))
        rec.calls += 1
        rec.elements += tensor.numel()
        rec.bytes += tensor.numel() * tensor.element_size()

    def total(self, op: str | None = None, tag: str | None = None, axis: str | None = None):
        """(calls, elements, bytes) summed over records matching the given fields."""
        recs = [
            r
            for r in self.records.values()
            if (op is None or r.op == op)
            and (tag is None or r.tag == tag)
            and (axis is None or r.axis == axis)
        ]
        return (
            sum(r.calls for r in recs),
            sum(r.elements for r in recs),
            sum(r.bytes for r in recs),
        )

    def bytes_by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records.values():
            out[r.op] = out.get(r.op, 0) + r.bytes
        return out

    def as_rows(self) -> list[dict]:
        return [vars(r).copy() for r in self.records.values()]


class Handle:
    """An in-flight call; wait() enforces the deadline and runs the finishing step (e.g. /n)."""

    def __init__(
        self,
        work: dist.Work | list[dist.Work] | None,
        describe: Callable[[], str],
        timeout_s: float,
        then: Callable[[], None] | None = None,
        blocking_wait: bool = True,
    ) -> None:
        self._works = work if isinstance(work, list) else ([] if work is None else [work])
        self._describe = describe
        self._timeout_s = timeout_s
        self._then = then
        self._blocking = blocking_wait
        self.done = not self._works

    def poll(self) -> bool:
        """True once every work has completed (without blocking or running `then`)."""
        return self.done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self.done:
            return
        try:
            for work in self._works:
                if self._blocking:
                    work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))
                else:  # NCCL: the stream waits; the watchdog enforces the process-group timeout
                    work.wait()
        except RuntimeError as e:
            text = str(e)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CommTimeoutError(
                    f"{self._describe()} did not complete within {self._timeout_s:g}s "
                    f"(a rank may have failed or diverged): {text.splitlines()[0]}"
                ) from e
            raise CommError(f"{self._describe()} failed: {text.splitlines()[0]}") from e
        self.done = True
        if self._then is not None:
            self._then()


@dataclass
class P2PHandle:
    """A posted batch of sends and receives.

    A received tensor may be read once `receives` completes; a sent tensor must stay
    unmodified until `sends` completes. Waiting for the receives alone lets a rank go on
    computing while its sends drain (a gloo send completes only once the peer has posted
    the matching receive). Where the backend coalesces the batch into one work (NCCL),
    `receives` covers the whole batch and `sends` is empty.
    """

    receives: Handle
    sends: Handle

    def wait(self) -> None:
        self.receives.wait()
        self.sends.wait()

    def sends_done(self) -> bool:
        """Whether every send has completed (without blocking)."""
        return self.sends.poll()


class Comm:
    """Collectives over the axes of a Mesh, counted and deadline-checked."""

    def __init__(self, mesh: Mesh, stats: CommStats | None = None) -> None:
        self.mesh = mesh
        self.stats = stats or CommStats()
        self._blocking_wait = mesh.device.type != "cuda"

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(
        self, t: torch.Tensor, axis: str, op: str = "sum", tag: str = "", async_op: bool = False
    ) -> Handle:
        """In-place reduction over `axis`; 'avg' divides by the axis size after the sum."""
        n = self.mesh.size(axis)
        if n == 1:
            return Handle(None, str, 0)
        self.stats.record("all_reduce", axis, t, tag)
        work = dist.all_reduce(t, op=_REDUCE_OPS[op], group=self.mesh.group(axis), async_op=True)
        then = (lambda: t.div_(n)) if op == "avg" else None
        return self._finish(work, "all_reduce", axis, t, then, async_op)

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, axis: str, tag: str = "", async_op: bool = False
    ) -> Handle:
        """Concatenate every rank's `inp` along dim 0 into `out` (n times larger)."""
        if self.mesh.size(axis) == 1:
            out.copy_(inp)
            return Handle(None, str, 0)
        self.stats.record("all_gather", axis, out, tag)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, inp, group=self.mesh.group(axis), async_op=True)
        return self._finish(work, "all_gather", axis, out, None, async_op)

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        axis: str,
        op: str = "sum",
        tag: str = "",
        async_op: bool = False,
    ) -> Handle:
        """Reduce `inp` over `axis` and keep this rank's 1/n slice (dim 0) in `out`."""
        n = self.mesh.size(axis)
        if n == 1:
            out.copy_(inp)
            return Handle(None, str, 0)
        self.stats.record("reduce_scatter", axis, inp, tag)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = scatter(out, inp, op=_REDUCE_OPS[op], group=self.mesh.group(axis), async_op=True)
        then = (lambda: out.div_(n)) if op == "avg" else None
        return self._finish(work, "reduce_scatter", axis, inp, then, async_op)

    def all_gather_object(self, obj: object, axis: str, tag: str = "") -> list[object]:
        """Every rank's picklable `obj`, in axis-rank order (metadata, not training traffic:
        counted as a call of zero bytes, since its size is known only once pickled)."""
        n = self.mesh.size(axis)
        if n == 1:
            return [obj]
        self.stats.record("all_gather_object", axis, torch.empty(0, dtype=torch.uint8), tag)
        out: list[object] = [None] * n
        dist.all_gather_object(out, obj, group=self.mesh.group(axis))
        return out

    def agreed_stop(self, done: int, requested: bool, key: str = "plait/stop") -> bool:
        """Whether this rank stops now, `done` steps completed, the same answer on every rank.

        A rank that was asked to stop proposes `done + 1`: no rank can have completed more
        steps than that yet (a step's collectives wait for this rank), so every rank still
        reaches that count and stops there. The first proposal wins, through the process
        group's key-value store (the one it was started with, `Mesh.store`): one round trip
        per step, and no collective that a rank which already stopped would leave others
        waiting in."""
        if self.mesh.world_size == 1 or not dist.is_initialized():
            return requested
        store = self.mesh.store
        if store is None:
            raise RuntimeError(
                "agreeing on a stop needs the store the process group was started with: "
                "pass it to build_mesh(..., store=...) (launch.init_worker does)"
            )
        if requested:
            store.compare_set(key, "", str(done + 1))
        if not store.check([key]):
            return False
        return done >= int(store.get(key))

    def broadcast(self, t: torch.Tensor, axis: str, src: int = 0, tag: str = "") -> None:
        """Copy axis-rank `src`'s tensor to every rank of `axis`."""
        if self.mesh.size(axis) == 1:
            return
        self.stats.record("broadcast", axis, t, tag)
        global_src = self.mesh.ranks(axis)[src]
        work = dist.broadcast(t, src=global_src, group=self.mesh.group(axis), async_op=True)
        self._finish(work, "broadcast", axis, t, None, False)

    # -- to and from one rank (the naive data parallelism a course starts from) -----------
    def scatter(self, out: torch.Tensor, whole: torch.Tensor | None, axis: str, src: int = 0):
        """Axis-rank `src` splits `whole` along dim 0 and sends each rank its part (`out`)."""
        self._rooted("scatter", dist.scatter, out, whole, axis, src, "scatter_list")

    def gather(self, whole: torch.Tensor | None, inp: torch.Tensor, axis: str, dst: int = 0):
        """Every rank's `inp`, concatenated along dim 0 into `whole` on axis-rank `dst`."""
        self._rooted("gather", dist.gather, inp, whole, axis, dst, "gather_list")

    def reduce(self, t: torch.Tensor, axis: str, dst: int = 0, tag: str = "") -> None:
        """Sum `t` over `axis` into axis-rank `dst`'s `t` (the others' `t` is left undefined)."""
        if self.mesh.size(axis) == 1:
            return
        self.stats.record("reduce", axis, t, tag)
        root, group = self.mesh.ranks(axis)[dst], self.mesh.group(axis)
        work = dist.reduce(t, dst=root, group=group, async_op=True)
        self._finish(work, "reduce", axis, t, None, False)

    def _rooted(self, op: str, fn, mine, whole, axis: str, root: int, list_arg: str) -> None:
        """scatter or gather: `whole` (n parts along dim 0) lives on axis-rank `root` only.
        Counted as the whole tensor's bytes on every rank, as all_gather counts its output."""
        n = self.mesh.size(axis)
        if n == 1:
            (whole.copy_(mine) if op == "gather" else mine.copy_(whole))
            return
        self.stats.record(
            op, axis, torch.empty((n, *mine.shape), dtype=mine.dtype, device="meta"), ""
        )
        ranks, group = self.mesh.ranks(axis), self.mesh.group(axis)
        parts = list(whole.chunk(n)) if self.mesh.axis_rank(axis) == root else None
        kw = {list_arg: parts, ("src" if op == "scatter" else "dst"): ranks[root]}
        work = fn(mine, group=group, async_op=True, **kw)
        self._finish(work, op, axis, mine, None, False)  # parts are views: `whole` is filled

    def p2p(
        self, ops: list[tuple[str, torch.Tensor, int]], axis: str = "pp", tag: str = ""
    ) -> P2PHandle:
        """Post sends and receives together; ops are ('send'|'recv', tensor, peer axis-rank).

        One batch (batch_isend_irecv) so NCCL can pair them without deadlock; a send and its
        receive are matched by order between each pair of ranks. The result can be waited
        for whole, or its receives and sends separately (see P2PHandle).
        """
        ranks = self.mesh.ranks(axis)
        p2p_ops = []
        for kind, t, peer in ops:
            self.stats.record(kind, axis, t, tag)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(fn, t, ranks[peer], self.mesh.group(axis)))
        works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        step, me = self.stats.step, self.mesh.rank

        def describe(kinds: tuple[str, ...]) -> Callable[[], str]:
            def text() -> str:
                what = ", ".join(
                    f"{k} {t.numel()} to/from {axis} rank {p}" for k, t, p in ops if k in kinds
                )
                return f"p2p [{what}] at step {step} on rank {me}"

            return text

        def handle(picked: list, kinds: tuple[str, ...]) -> Handle:
            return Handle(picked, describe(kinds), self.mesh.timeout_s, None, self._blocking_wait)

        if len(works) != len(ops):  # one coalesced work (NCCL): receives complete with sends
            return P2PHandle(handle(works, ("send", "recv")), handle([], ()))
        recvs = [w for w, (k, _, _) in zip(works, ops, strict=True) if k == "recv"]
        sends = [w for w, (k, _, _) in zip(works, ops, strict=True) if k == "send"]
        return P2PHandle(handle(recvs, ("recv",)), handle(sends, ("send",)))

    def all_reduce_flat(
        self, tensors: list[torch.Tensor], axis: str, op: str = "sum", tag: str = ""
    ) -> None:
        """Reduce several tensors in place with one all-reduce of a flat copy (one call and
        one launch latency instead of one per tensor)."""
        if not tensors or self.mesh.size(axis) == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat, axis, op=op, tag=tag)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view_as(t))

    def barrier(self, axis: str = "world") -> None:
        """A tiny all-reduce rather than dist.barrier, so it obeys the same deadline."""
        self.all_reduce(torch.zeros(1, device=self.mesh.device), axis, tag="barrier")

    # -- helpers -------------------------------------------------------------------------
    def _finish(self, work, op: str, axis: str, t: torch.Tensor, then, async_op: bool) -> Handle:
        step = self.stats.step
        ranks = self.mesh.ranks(axis)

        def describe() -> str:
            return (
                f"{op} on axis {axis} (ranks {ranks}, {t.numel()} x {t.dtype}) at step {step}"
                f" on rank {self.mesh.rank}"
            )

        handle = Handle(work, describe, self.mesh.timeout_s, then, self._blocking_wait)
        if not async_op:
            handle.wait()
        return handle
