"""Stopping a run on a signal: finish the step, save, end; a second signal ends at once.

SIGINT (Ctrl-C reaches every process of the group), SIGTERM (`kill`, Slurm preemption,
`scancel`), and SIGUSR1 or SIGUSR2 (the launcher passing on a SIGINT or SIGTERM it received
alone) ask a worker to stop. Ranks see the request at different moments, so they agree on
the step to stop after (`Comm.agreed_stop`), finish it, write a checkpoint and end
normally. A second SIGINT or SIGTERM to a worker ends it at once (its checkpoint, if one was
being written, is never committed and so never loaded).

Before a run can stop after a step (a worker starting, joining the world, building its
model) and in commands that have no step (data prepare, tokenizer train, a lesson's case), a
signal raises `Stopping` instead: the command cleans up what it was writing and ends in one
line with exit 128 + signal. Workers start with these signals blocked (`blocked`), so a
Ctrl-C while a worker still imports torch is taken once the worker can handle it, not as a
KeyboardInterrupt traceback from the spawn machinery.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

FORWARDED = {signal.SIGUSR1: signal.SIGINT, signal.SIGUSR2: signal.SIGTERM}
"""What the launcher sends its workers when it alone received SIGINT or SIGTERM, one signal
for each: a worker tells the launcher's request from its own and still names the signal."""


def forward_of(signum: int) -> int:
    """The signal the launcher sends its workers for `signum` (SIGINT or SIGTERM)."""
    return next(f for f, original in FORWARDED.items() if original == signum)


HANDLED = (signal.SIGINT, signal.SIGTERM, *FORWARDED)
"""The signals that ask plait to stop: sent to it, or passed on by its launcher."""


class Stopping(KeyboardInterrupt):
    """A stop asked where nothing can finish first: raised by `raise_stopping` in the main
    thread. A KeyboardInterrupt, so that every `except KeyboardInterrupt` path (cleanup of a
    partial output, the one line of `plait.cli.main`) serves SIGTERM as it serves Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopping(signum: int, frame: FrameType | None) -> None:
    """The handler of `HANDLED` outside a run's steps: a forward is named as what it was."""
    raise Stopping(FORWARDED.get(signum, signum))


@contextmanager
def stopping_raised(then: signal.Handlers | None = None) -> Iterator[None]:
    """While inside, every signal of `HANDLED` raises `Stopping`; after, the previous handlers
    or `then` (SIG_IGN: a spawned worker whose work is done ends whatever comes next)."""
    previous = {s: signal.signal(s, raise_stopping) for s in HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if then is None else then)


@contextmanager
def blocked() -> Iterator[None]:
    """Hold `HANDLED` while starting processes: a child inherits the mask through fork and
    exec, so a signal that reaches it before its own handlers exist waits (`unblock`) instead
    of interrupting its imports. Here, what arrived meanwhile is delivered on leaving.

    multiprocessing's resource tracker is started first: starting it (on the first spawn)
    unblocks SIGINT and SIGTERM in this process, and the workers after it would start with
    them unblocked."""
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def deferred() -> Iterator[None]:
    """While inside, a signal of `HANDLED` is noted, not raised; on leaving (without an error
    of its own) the first one noted raises `Stopping`. For work that must not be cut in half:
    a pool's worker launched through the forkserver, its parent stopped between asking for
    it and sending it its task, prints an EOFError traceback after plait's last line. The
    handler runs in the main thread whichever thread the signal reached."""
    noted: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(FORWARDED.get(signum, signum))

    previous = {s: signal.signal(s, note) for s in HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if noted:
        raise Stopping(noted[0])


def unblock() -> None:
    """In a child started under `blocked`, once its handlers are set: take what waited."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)


def exit_code(signum: int) -> int:
    """The shell's convention, the one plait uses for every stop by a signal: 130, 143."""
    return 128 + signum


class StopRequest:
    """Installed in a worker's main thread for the length of a run."""

    def __init__(self) -> None:
        self.signum: int | None = None  # what was sent (to this worker, or to the launcher)
        self._direct = False  # a signal reached this worker itself: a second one ends it
        self._previous = {s: signal.signal(s, self._handle) for s in HANDLED}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # One Ctrl-C reaches a worker twice: SIGINT to the whole group and the launcher's
        # forward, in either order (on two cores the launcher can pass it on before the
        # kernel has delivered the group's SIGINT here). Only a second direct signal is a
        # second request.
        if signum in FORWARDED:
            if self.signum is None:
                self.signum = FORWARDED[signum]
            return
        if self._direct:
            os._exit(128 + signum)  # asked twice: no more waiting for the step or the save
        self._direct, self.signum = True, signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


PAUSE_ENV = "PLAIT_PAUSE_AT"


def pause_at(phase: str, who: str) -> None:
    """Test hook, at one-time phases only (never on a step's path): with PLAIT_PAUSE_AT set
    to 'PHASE:FOLDER' (or 'PHASE,PHASE:FOLDER') naming this `phase`, write FOLDER/PHASE.WHO
    and wait until FOLDER/PHASE.go exists (or this process is stopped).

    A test that must act at a phase (Ctrl-C once every calibrate worker ignores it; a second
    signal once the launcher has passed the first on) waits for the marker instead of a
    fixed time, which a loaded machine outlasts (a worker still importing takes Ctrl-C as a
    KeyboardInterrupt).
    """
    want, _, folder = os.environ.get(PAUSE_ENV, "").partition(":")
    if phase not in want.split(",") or not folder:
        return
    Path(folder, f"{phase}.{who}").write_text(str(os.getpid()))
    while not Path(folder, f"{phase}.go").exists():
        time.sleep(0.01)


def pausing_after_first(items: Iterable[T], phase: str, who: str) -> Iterator[T]:
    """`items`, with `pause_at(phase, who)` once the first was taken: a test's signal then
    reaches work under way (a tokenizer training on the texts it reads)."""
    for i, item in enumerate(items):
        yield item
        if i == 0:
            pause_at(phase, who)


@contextmanager
def stoppable(items: Iterable[T]) -> Iterator[Iterator[T]]:
    """`items`, raising `Stopping` at the next item once a signal of `HANDLED` has arrived,
    even when native code reads them from a thread of its own.

    The Rust tokenizer trains for minutes without returning to Python and reads its texts
    from another thread: no signal handler can run until it returns (only the main thread
    runs them), so a Ctrl-C would wait for the whole training. Python's C-level handler
    also writes the signal's number to the wakeup file descriptor, from any thread, at
    once: the reading thread sees it there and ends the training with `Stopping`. (Work
    that reads no item, BPE's merges, still runs to its end first.)"""
    if threading.current_thread() is not threading.main_thread():
        yield iter(items)
        return
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)
    previous = signal.set_wakeup_fd(write)

    def arrived() -> None:
        try:
            sent = os.read(read, 64)
        except BlockingIOError:
            return
        for signum in sent:  # any other signal with a Python handler is not a stop
            if signum in HANDLED:
                raise Stopping(FORWARDED.get(signum, signum))

    def checked() -> Iterator[T]:
        for item in items:
            arrived()
            yield item
        arrived()

    try:
        yield checked()
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
