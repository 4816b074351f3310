"""Posting a rank's pipeline sends and receives: receives before use, sends drained lazily.

Both runtimes (the synchronous schedules and asynchronous 2BW) walk their action lists in the
batches `comm_batches` gives and hand each run of consecutive SEND/RECV actions here. The
batch is posted at once; its receives are waited for before the next action (a compute
action may read them), its sends are not: a rank goes on computing while they drain, and
they are waited for when the step ends. A gloo send completes only once the peer has posted
the matching receive, so waiting for it would idle the sender until the receiver gets there.

Deadlock freedom: this is the validator's "buffered" model (sends never block), which it
proves for every schedule, and posting order per pair of ranks is unchanged, so sends and
receives still match by order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from plait.comm import Comm, P2PHandle
from plait.parallel.pipeline.actions import Action, Kind


class Buffers(Protocol):
    """Where a runtime keeps tensors in flight, keyed by its own micro-batch key."""

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

    def post(self, acts: list[Action], keys: list, bufs: Buffers) -> None:
        """Post one batch (acts[i] keyed by keys[i]); return once its receives are in."""
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
        handle.receives.wait()
        self._forget_finished()
        if sent:
            self.pending.append((handle, sent))  # the tensors live until their send is done

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
        """Wait for every send posted so far (at the end of a step)."""
        for handle, _ in self.pending:
            handle.sends.wait()
        self.pending = []
