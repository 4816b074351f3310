"""Each command imports only what it runs: `plait.cli.dispatch` imports a command's own module
when that command is named, so the planner's and the estimator's commands start without the
trainer, the launcher, checkpoints or the instruction-data pipeline, and `plait schedule`
without torch. Each case runs the command in a fresh interpreter and reads `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from plait.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""

RUNNING = {  # what only a run (or another command) needs
    "plait.launch",
    "plait.train",
    "plait.run",
    "plait.step",
    "plait.comm",
    "plait.mesh",
    "plait.checkpoint",
    "plait.calibrate",
    "plait.evaluate",
    "plait.lessons",
    "plait.telemetry",
    "plait.parallel.pipeline",
    "plait.parallel.tp",
    "plait.models.hf",
    "plait.data.instruct",
    "plait.cli.train",
    "plait.cli.models",
    "plait.cli.data",
    "safetensors",
    "jinja2",
    "transformers",
}

CASES = {
    "plan": "plan --model tiny-gpt --gpus 2 --global-batch 8 --seq-len 64",
    "estimate": "estimate --model tiny-gpt --dp 2 --global-batch 16 --seq-len 64",
    "schedule": "schedule --pp 2 --microbatches 4",
}


def _imported(argv: list[str]) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["code"] == 0, out.stderr
    return set(found["modules"])


def _loaded(modules: set[str], roots: set[str]) -> list[str]:
    """The roots of `roots` that `modules` holds (a root or any module under it)."""
    return sorted(r for r in roots if any(m == r or m.startswith(r + ".") for m in modules))


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_command_imports_only_what_it_runs(command: str) -> None:
    modules = _imported(CASES[command].split())
    assert f"plait.cli.{command}" in modules  # the probe ran the command it names
    assert _loaded(modules, RUNNING) == []
    others = {f"plait.cli.{c}" for c in CASES if c != command}
    assert _loaded(modules, others) == []
    if command == "schedule":
        assert _loaded(modules, {"torch", "numpy"}) == []
