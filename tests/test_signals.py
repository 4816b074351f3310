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


@pytest.mark.parametrize("command", [["presets"], ["train", "--steps", "1", "--out", "{out}"]])
def test_ctrl_c_while_plait_starts_is_one_line_and_130(tmp_path, command):
    """Ctrl-C before the command's own handling starts (Python importing torch and the
    commands for seconds): one line, exit 130, no traceback. The process is paused at the
    'start' phase and signalled there, so the test does not race the imports."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from plait.signals import PAUSE_ENV

    env = {**os.environ, PAUSE_ENV: f"start:{tmp_path}"}
    argv = [arg.format(out=tmp_path / "run") for arg in command]
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker, deadline = Path(tmp_path, "start.plait"), time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["plait: interrupted; nothing more runs."], err
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "run").exists()


def test_a_signal_reaches_items_read_by_another_thread():
    """Native code reading items from a thread of its own (the Rust tokenizer) cannot run a
    signal handler; `stoppable` still ends the reading with `Stopping` at the next item,
    naming the signal, and puts the wakeup descriptor back."""
    import os
    import threading

    from plait.signals import Stopping, stoppable

    seen, caught = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a Python handler
    with stoppable(iter(range(1000))) as items:

        def read() -> None:  # the reading thread: it never runs a Python signal handler
            try:
                for item in items:
                    seen.append(item)
                    if item == 2:
                        os.kill(os.getpid(), signal.SIGTERM)
                        threading.Event().wait(0.2)  # the C handler wrote the byte by now
            except Stopping as e:
                caught.append(e.signum)

        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
    signal.signal(signal.SIGTERM, previous)
    assert caught == [signal.SIGTERM] and seen == [0, 1, 2]
    assert signal.set_wakeup_fd(-1) == -1  # restored: none was set before


def test_workers_start_with_the_stop_signals_blocked():
    """A process started inside `blocked` inherits the mask (so a Ctrl-C waits for its
    handler instead of interrupting its imports), even when multiprocessing's resource
    tracker starts on that first spawn (starting it unblocks SIGINT and SIGTERM)."""
    import multiprocessing

    from plait.signals import HANDLED, blocked

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with blocked():
        procs = [ctx.Process(target=_report_mask, args=(queue,)) for _ in range(2)]
        for p in procs:
            p.start()
    masks = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    assert all(set(HANDLED) <= mask for mask in masks)
    assert not set(HANDLED) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this one: as was


def _report_mask(queue) -> None:
    queue.put(signal.pthread_sigmask(signal.SIG_BLOCK, []))
