"""Posting a rank's pipeline sends and receives: receives waited for at use, sends drained lazily.

The walker (`walker.py`: the synchronous schedules and asynchronous 2BW alike) walks an action
list in the batches `comm_batches` gives and hands each run of consecutive SEND/RECV actions
here. The batch is posted at once, where the schedule puts it, which is often well before the
data is needed (a schedule posts the receive of the next gradient before an unrelated forward,
as Megatron's and torch's runtimes pre-post theirs). A receive is waited for only right before
the compute action that reads it (`wait_for`), so that forward runs while the message is
still on its way. Sends are not waited for: a rank goes on computing while they drain, and
they are waited for when the step ends. A gloo send completes only once the peer has posted
the matching receive, so waiting for it would idle the sender until the receiver gets there.

Deadlock freedom: the validator proves every schedule deadlock-free when sends never block
and each batch's receives are waited for before the rank's next action (its "buffered"
model). Waiting for a receive later than that only lets a rank get further before it blocks,
posting the same operations in the same order, so no wait that completed there can stall
here; posting order per pair of ranks is unchanged, so sends and receives still match by
order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from plait.comm import Comm, Handle, P2PHandle
from plait.schedule.actions import Action, Kind


class Buffers(Protocol):
    """Where the walker keeps tensors in flight (`walker.Flight`), keyed by micro-batch."""

    inputs: dict  # received activations (stage inputs)
    outputs: dict  # stage outputs to send forward
    grads_in: dict  # gradients w.r.t. stage inputs, to send back
    grads_out: dict  # received gradients w.r.t. stage outputs


@dataclass
class Exchange:
    """One rank's pipeline p2p: posts batches, keeps unfinished sends (and their tensors)."""

    comm: Comm
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    pending: list[tuple[P2PHandle, list[Tensor]]] = field(default_factory=list)
    arriving: dict[tuple[Kind, Any], Handle] = field(default_factory=dict)

    def post(self, acts: list[Action], keys: list, bufs: Buffers) -> None:
        """Post one batch (acts[i] keyed by keys[i]); its receives land in `bufs` and must be
        waited for with `wait_for` before they are read."""
        ops, sent = [], []
        for a, key in zip(acts, keys, strict=True):
            if a.kind is Kind.SEND_F:
                sent.append(bufs.outputs[key].detach().contiguous())
            elif a.kind is Kind.SEND_B:
                sent.append(bufs.grads_in.pop(key).contiguous())
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                (bufs.inputs if a.kind is Kind.RECV_F else bufs.grads_out)[key] = buf
                ops.append(("recv", buf, a.peer))
                continue
            ops.append(("send", sent[-1], a.peer))
        handle = self.comm.p2p(ops, axis="pp", tag="pipeline")
        for a, key in zip(acts, keys, strict=True):
            if a.is_recv:
                self.arriving[(a.kind, key)] = handle.receives
        self._forget_finished()
        if sent:
            self.pending.append((handle, sent))  # the tensors live until their send is done

    def wait_for(self, a: Action, key: Any) -> None:
        """Before compute action `a` (keyed `key`) runs: wait for the received tensor it
        reads, if one was posted (an F's activation, a B's gradient; the first stage's F and
        the last stage's B read none). Waiting here, not at posting, keeps the wait out of
        the compute's timing too: it is idle time in the trace."""
        recv = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}.get(a.kind)
        handle = self.arriving.pop((recv, key), None)
        if handle is not None:
            handle.wait()

    def _forget_finished(self) -> None:
        """Drop sends that completed (their wait() returns at once, raising any error)."""
        keep = []
        for handle, tensors in self.pending:
            if handle.sends_done():
                handle.sends.wait()
            else:
                keep.append((handle, tensors))
        self.pending = keep

    def drain(self) -> None:
        """Wait for every receive and send posted so far (at the end of a step, or at a 2BW
        update point), so nothing is in flight."""
        for handle in self.arriving.values():
            handle.wait()
        self.arriving = {}
        for handle, _ in self.pending:
            handle.sends.wait()
        self.pending = []
