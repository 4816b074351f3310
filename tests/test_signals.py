"""A worker's stop request, without processes: one Ctrl-C arrives twice (the group's SIGINT
and the launcher's SIGUSR1), in either order, and must not count as being asked twice; a
signal sent to the launcher alone is named as what it was."""

from __future__ import annotations

import signal

import pytest

from plait.signals import StopRequest, forward_of

FORWARD = forward_of(signal.SIGINT)


@pytest.mark.parametrize("order", [(signal.SIGINT, FORWARD), (FORWARD, signal.SIGINT)],
                         ids=["group-first", "launcher-first"])  # fmt: skip
def test_one_ctrl_c_is_one_request_in_either_order(order):
    stop = StopRequest()
    try:
        for signum in order:
            stop._handle(signum, None)  # a second request would os._exit this process
        assert stop.requested and stop.signum == signal.SIGINT  # reported as what was sent
    finally:
        stop.restore()


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_launchers_forward_alone_is_a_request_naming_its_signal(sent):
    stop = StopRequest()
    try:
        stop._handle(forward_of(sent), None)
        stop._handle(forward_of(sent), None)  # the launcher forwards once per signal it receives
        assert stop.requested and stop.signum == sent
        assert forward_of(sent) in (signal.SIGUSR1, signal.SIGUSR2)
    finally:
        stop.restore()
