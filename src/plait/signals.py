"""Stopping a run on a signal: finish the step, save, end; a second signal ends at once.

SIGINT (Ctrl-C reaches every process of the group), SIGTERM (`kill`, Slurm preemption,
`scancel`), and SIGUSR1 or SIGUSR2 (the launcher passing on a SIGINT or SIGTERM it received
alone) ask a worker to stop. Ranks see the request at different moments, so they agree on
the step to stop after (`Comm.agreed_stop`), finish it, write a checkpoint and end
normally. A second SIGINT or SIGTERM to a worker ends it at once (its checkpoint, if one was
being written, is never committed and so never loaded).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType

FORWARDED = {signal.SIGUSR1: signal.SIGINT, signal.SIGUSR2: signal.SIGTERM}
"""What the launcher sends its workers when it alone received SIGINT or SIGTERM, one signal
for each: a worker tells the launcher's request from its own and still names the signal."""


def forward_of(signum: int) -> int:
    """The signal the launcher sends its workers for `signum` (SIGINT or SIGTERM)."""
    return next(f for f, original in FORWARDED.items() if original == signum)


class StopRequest:
    """Installed in a worker's main thread for the length of a run."""

    def __init__(self) -> None:
        self.signum: int | None = None  # what was sent (to this worker, or to the launcher)
        self._direct = False  # a signal reached this worker itself: a second one ends it
        handled = (signal.SIGINT, signal.SIGTERM, *FORWARDED)
        self._previous = {s: signal.signal(s, self._handle) for s in handled}

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
    to 'PHASE:FOLDER' for this `phase`, write FOLDER/PHASE.WHO and wait until FOLDER/PHASE.go
    exists (or this process is stopped).

    A test that must act at a phase (Ctrl-C once every calibrate worker ignores it; a second
    signal once the launcher has passed the first on) waits for the marker instead of a
    fixed time, which a loaded machine outlasts (a worker still importing takes Ctrl-C as a
    KeyboardInterrupt).
    """
    want, _, folder = os.environ.get(PAUSE_ENV, "").partition(":")
    if want != phase or not folder:
        return
    Path(folder, f"{phase}.{who}").write_text(str(os.getpid()))
    while not Path(folder, f"{phase}.go").exists():
        time.sleep(0.01)
