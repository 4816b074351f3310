"""Test faults injected into a real run: one rank raises at a chosen step or save.

`PLAIT_FAULT='RANK:STEP'` makes rank RANK raise before step STEP; `'RANK:save-N'` while it
saves the step-N checkpoint, before the checkpoint is committed; on the first start of the
world only, so a restarted world runs through. They exist so the failure paths (one rank
dies, all stop, its traceback shown; a restart from the newest checkpoint; a save cut short)
are tested end to end through the real launcher and torchrun.

Production never pays for them: the launcher's training target reads the variable once, at
start (`from_env`), and passes the fault to `run.run` as its hook only on the rank that is to
fail; everywhere else the hook is None and the step loop has no fault check at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_ENV = "PLAIT_FAULT"


@dataclass(frozen=True)
class InjectedFault:
    """A run hook (`run.RunHook`) that raises at one point of this rank's run."""

    spec: str  # the variable's value, quoted in the error
    rank: int
    step: int
    while_saving: bool  # 'save-N': before the step-N checkpoint is committed

    def before_step(self, step: int) -> None:
        if not self.while_saving and step == self.step:
            self._fail(str(step))

    def before_commit(self, step: int) -> None:
        if self.while_saving and step == self.step:
            self._fail(f"save-{step}")

    def _fail(self, where: str) -> None:
        raise RuntimeError(
            f"injected fault ({FAULT_ENV}={self.spec}) on rank {self.rank} at step {where}"
        )


def parse_fault(spec: str) -> InjectedFault:
    """'RANK:STEP' or 'RANK:save-N'; a malformed value is refused, not ignored (a test that
    sets it expects a failure)."""
    rank, _, at = spec.partition(":")
    step = at.removeprefix("save-")
    if not (rank.isdigit() and step.isdigit()):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected 'RANK:STEP' or 'RANK:save-STEP'")
    return InjectedFault(spec, int(rank), int(step), at.startswith("save-"))


def from_env(rank: int, attempt: int) -> InjectedFault | None:
    """The fault `PLAIT_FAULT` asks of this rank on this start of the world (`attempt`, 0:
    the first), or None: not set, another rank's, or a restart."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault = parse_fault(spec)
    return fault if fault.rank == rank and attempt == 0 else None
