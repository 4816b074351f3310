"""The test faults (`PLAIT_FAULT`) are read once, at start, and reach only the rank that is to
fail; a run without one has no hook. End to end through the launcher: tests/test_launch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plait import launch
from plait.faults import FAULT_ENV, InjectedFault, from_env, parse_fault
from plait.mesh import single_process_mesh
from plait.run import run
from reference import corpus_for, small_config


def test_no_variable_no_fault(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert from_env(0, 0) is None


def test_the_fault_reaches_its_rank_on_the_first_start_only(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:3")
    assert from_env(0, 0) is None
    assert from_env(1, 1) is None  # a restarted world runs through
    assert from_env(1, 0) == InjectedFault("1:3", 1, 3, while_saving=False)


def test_a_step_fault_raises_before_that_step_only():
    fault = parse_fault("0:2")
    fault.before_step(1)
    fault.before_commit(2)
    with pytest.raises(RuntimeError, match=r"fault \(PLAIT_FAULT=0:2\) on rank 0 at step 2"):
        fault.before_step(2)


def test_a_save_fault_raises_before_that_commit_only():
    fault = parse_fault("1:save-4")
    fault.before_step(4)
    fault.before_commit(2)
    with pytest.raises(RuntimeError, match=r"PLAIT_FAULT=1:save-4\) on rank 1 at step save-4"):
        fault.before_commit(4)


@pytest.mark.parametrize("spec", ["1", "x:2", "1:", "1:save-", "1:saves-2", "-1:2"])
def test_a_malformed_fault_is_refused(spec):
    with pytest.raises(ValueError, match="RANK:STEP"):
        parse_fault(spec)


def test_the_launchers_run_gets_no_hook_without_the_variable(monkeypatch):
    hooks = []
    monkeypatch.setattr(launch, "run", lambda cfg, mesh, hook, attempt: hooks.append(hook))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    launch.training_run(None, SimpleNamespace(rank=1))
    monkeypatch.setenv(FAULT_ENV, "1:save-2")
    launch.training_run(None, SimpleNamespace(rank=1))
    assert hooks == [None, parse_fault("1:save-2")]


@pytest.mark.parametrize("variable", [launch.ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT"])
def test_the_launchers_run_is_told_which_start_of_the_world_it_is(monkeypatch, variable):
    """The launcher counts the world's starts (its own, or torchrun's restarts) and the run
    it starts is told the count: the summary's restarts, each start's stop agreement."""
    starts = []
    monkeypatch.setattr(launch, "run", lambda cfg, mesh, hook, attempt: starts.append(attempt))
    for name in (FAULT_ENV, launch.ATTEMPT_ENV, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    launch.training_run(None, SimpleNamespace(rank=0))
    monkeypatch.setenv(variable, "2")
    launch.training_run(None, SimpleNamespace(rank=0))
    assert starts == [0, 2]


class _Recorder:
    def __init__(self) -> None:
        self.points: list[str] = []

    def before_step(self, step: int) -> None:
        self.points.append(f"step {step}")

    def before_commit(self, step: int) -> None:
        self.points.append(f"commit {step}")


def test_the_run_calls_its_hook_before_each_step_and_commit(tmp_path):
    cfg = small_config(steps=4, save_every=2, out=str(tmp_path))
    hook = _Recorder()
    summary = run(cfg, single_process_mesh(torch.device("cpu")), corpus_for(cfg), hook)
    assert hook.points == ["step 0", "step 1", "commit 2", "step 2", "step 3", "commit 4"]
    assert summary.checkpoint and summary.checkpoint.endswith("step-4")
