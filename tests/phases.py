"""Acting at a phase of a running command, not after a fixed time (no tests here).

The code under test calls `plait.signals.pause_at(phase, who)` at a few one-time phases; a
test that sets PLAIT_PAUSE_AT='PHASE:FOLDER' for the command makes each process that reaches
the phase write FOLDER/PHASE.WHO and wait there until FOLDER/PHASE.go exists. The test
waits for the markers, acts (sends a signal), and releases the phase if the run must go on.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from plait.signals import PAUSE_ENV


def pause_env(phase: str, folder: Path) -> dict[str, str]:
    """The environment that pauses `phase`, its markers in `folder`."""
    return {PAUSE_ENV: f"{phase}:{folder}"}


def wait_for_phase(
    folder: Path, phase: str, who: list[str], proc: subprocess.Popen, timeout: float = 120.0
) -> None:
    """Return once every process named in `who` has reached `phase` (and waits there)."""
    deadline = time.monotonic() + timeout
    while not all((folder / f"{phase}.{w}").exists() for w in who):
        if proc.poll() is not None:
            raise AssertionError(
                f"ended with {proc.returncode} before {phase}:\n{proc.stderr.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{phase} not reached by {who} within {timeout:g} s")
        time.sleep(0.02)


def release(folder: Path, phase: str) -> None:
    """Let every process paused at `phase` go on."""
    (folder / f"{phase}.go").touch()
