"""The pipeline's p2p bookkeeping (`p2p.Exchange`), without processes: a receive is waited for
only by the compute that reads it, sends are never waited for before the step ends, and
`drain` leaves nothing in flight."""

from __future__ import annotations

import torch

from plait.comm import P2PHandle
from plait.parallel.pipeline.p2p import Exchange
from plait.parallel.pipeline.walker import Flight
from plait.schedule.actions import Action, Kind


class FakeHandle:
    """Stands in for comm.Handle: records whether it was waited for."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.done = name, log, False

    def wait(self) -> None:
        if not self.done:
            self.log.append(self.name)
        self.done = True

    def poll(self) -> bool:
        return self.done


class FakeComm:
    """Records the posted batches; each batch's receives and sends get their own handle."""

    def __init__(self) -> None:
        self.waited: list[str] = []
        self.batches: list[list[tuple[str, int]]] = []

    def p2p(self, ops, axis: str = "pp", tag: str = "") -> P2PHandle:
        n = len(self.batches)
        self.batches.append([(kind, peer) for kind, _, peer in ops])
        return P2PHandle(FakeHandle(f"recv{n}", self.waited), FakeHandle(f"send{n}", self.waited))  # type: ignore[arg-type]


def _exchange() -> tuple[Exchange, FakeComm, Flight]:
    comm = FakeComm()
    ex = Exchange(comm, (2, 3), torch.float32, torch.device("cpu"))  # type: ignore[arg-type]
    return ex, comm, Flight()


def test_a_receive_is_waited_for_only_by_its_reader():
    ex, comm, st = _exchange()
    st.grads_in[(0, 0)] = torch.ones(2, 3)
    # The schedule posts "send B0, receive B1" before an unrelated forward (interleaved 1F1B).
    ex.post([Action(Kind.SEND_B, 0, 0, peer=1), Action(Kind.RECV_B, 1, 0, peer=1)],
            [(0, 0), (1, 0)], st)  # fmt: skip
    assert comm.batches == [[("send", 1), ("recv", 1)]]
    assert st.grads_out[(1, 0)].shape == (2, 3)
    ex.wait_for(Action(Kind.F, 3, 0), (3, 0))  # reads tokens only
    ex.wait_for(Action(Kind.B, 0, 0), (0, 0))  # nothing posted for it
    assert comm.waited == []
    ex.wait_for(Action(Kind.B, 1, 0), (1, 0))  # reads the gradient
    assert comm.waited == ["recv0"]  # the receive, not the send
    ex.drain()
    assert comm.waited == ["recv0", "send0"]


def test_forward_waits_for_its_activation_and_the_last_stage_backward_for_nothing():
    ex, comm, st = _exchange()
    ex.post([Action(Kind.RECV_F, 0, 1, peer=0)], [(0, 1)], st)
    ex.wait_for(Action(Kind.B, 0, 1), (0, 1))  # the loss: no receive
    assert comm.waited == []
    ex.wait_for(Action(Kind.F, 0, 1), (0, 1))
    assert comm.waited == ["recv0"]


def test_drain_waits_for_receives_never_read():
    ex, comm, st = _exchange()
    ex.post([Action(Kind.RECV_F, 0, 0, peer=1)], [(0, 0)], st)
    ex.drain()  # a 2BW update point: nothing may stay in flight
    assert comm.waited == ["recv0"]
    assert ex.arriving == {} and ex.pending == []
