"""A worker's stop request, without processes: one Ctrl-C arrives twice (the group's SIGINT
and the launcher's SIGUSR1), in either order, and must not count as being asked twice."""

from __future__ import annotations

import signal

import pytest

from plait.signals import FORWARDED, StopRequest


@pytest.mark.parametrize("order", [(signal.SIGINT, FORWARDED), (FORWARDED, signal.SIGINT)],
                         ids=["group-first", "launcher-first"])  # fmt: skip
def test_one_ctrl_c_is_one_request_in_either_order(order):
    stop = StopRequest()
    try:
        for signum in order:
            stop._handle(signum, None)  # a second request would os._exit this process
        assert stop.requested and stop.signum == signal.SIGINT  # reported as what was sent
    finally:
        stop.restore()


def test_the_launchers_forward_alone_is_a_request():
    stop = StopRequest()
    try:
        stop._handle(FORWARDED, None)
        stop._handle(FORWARDED, None)  # the launcher forwards once per signal it receives
        assert stop.requested and stop.signum == FORWARDED
    finally:
        stop.restore()
