"""Acting at a phase of a running command, not after a fixed time (no tests here).

The code under test calls `plait.signals.pause_at(phase, who)` at a few one-time phases; a
test that sets PLAIT_PAUSE_AT='PHASE:FOLDER' for the command makes each process that reaches
the phase write FOLDER/PHASE.WHO and wait there until FOLDER/PHASE.go exists. The test
waits for the markers, acts (sends a signal), and releases the phase if the run must go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def processes_with(marker: str) -> list[int]:
    """PIDs whose environment carries `marker` (children inherit it; orphans would too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def start_plait(argv: list[str], marker: str, env: dict[str, str]) -> subprocess.Popen:
    """`plait ARGV` in a session of its own (a hung run is killed with all its workers),
    every process it starts marked by the environment variable `marker`."""
    return subprocess.Popen(
        [sys.executable, "-m", "plait.cli", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, marker: "1", **env},
        start_new_session=True,
    )  # fmt: skip


def ended(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The stderr of `proc` once it has ended; killed with its group if it does not."""
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
