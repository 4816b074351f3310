"""examples/slurm/'s batch scripts, without Slurm: their run's flags make a valid config
under the world each script starts and under one node fewer (`--dp auto`), and their shell
logic (restart a failed step, pass the time limit's SIGTERM on to srun, requeue after the
save) runs with stand-ins for `srun` and `scontrol` that only record how they were called."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from plait.cli import build_parser
from plait.cli.run_flags import config_from_args

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "slurm"
GPU_TASKS, NODE_TORCHRUN = EXAMPLES / "gpu-tasks.sbatch", EXAMPLES / "node-torchrun.sbatch"

SCONTROL = """#!/bin/bash
# stands in for scontrol: records its arguments; `show hostnames` names one host
echo "scontrol $*" >> "$FAKE_DIR/calls"
[ "$1" = show ] && echo node07
exit 0
"""
SRUN = """#!/bin/bash
# stands in for srun: records its arguments, then exits with its turn's code from FAKE_CODES
# ('wait': until SIGTERM, then 143, as srun ends when its tasks stopped on the signal)
echo "srun $*" >> "$FAKE_DIR/calls"
n=$(grep -c '^srun ' "$FAKE_DIR/calls")
code=$(echo $FAKE_CODES | cut -d' ' -f"$n")
if [ "$code" = wait ]; then
    trap 'kill $child; exit 143' TERM
    sleep 600 & child=$!
    touch "$FAKE_DIR/started"
    wait $child
fi
exit "$code"
"""


def _sbatch(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))


def _run_flags(script: Path) -> list[str]:
    """The script's RUN=( ... ) array, as bash splits it."""
    body = re.search(r"^RUN=\((.*?)\)$", script.read_text(), re.M | re.S)[1]
    return shlex.split(body, comments=True)


def _config(script: Path, env: dict[str, str], monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLURM_") or n in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["train", *_run_flags(script)])
    return config_from_args(args, check_data=False)


@pytest.mark.parametrize("nodes", [None, 1])
def test_each_scripts_run_is_valid_on_its_nodes_and_on_fewer(nodes, monkeypatch):
    """srun's variables for the task script, torchrun's for the node script: dp fills the
    world and the global batch stays whole."""
    for script in (GPU_TASKS, NODE_TORCHRUN):
        assert "--signal=B:TERM@120" in script.read_text()
        sbatch = _sbatch(script)
        per_node = int(sbatch["gpus-per-node"])
        world = per_node * (nodes or int(sbatch["nodes"]))
        if script == GPU_TASKS:
            env = {"SLURM_NTASKS": str(world), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                   "SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
                   "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "1"}  # fmt: skip
        else:
            env = {"RANK": "0", "WORLD_SIZE": str(world)}
        cfg = _config(script, env, monkeypatch)
        assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == world
        assert cfg.train.micro_batch * cfg.parallel.dp * cfg.accumulation == cfg.train.global_batch


def _script(script: Path, codes: str, tmp_path: Path) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "FAKE_CODES": codes, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_NNODES": "2"}  # fmt: skip
    return subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)


def _calls(tmp_path: Path, name: str) -> list[str]:
    lines = (tmp_path / "calls").read_text().splitlines()
    return [line for line in lines if line.startswith(name + " ")]


@pytest.mark.parametrize(
    "codes, code, restarts",
    [("1 0", 0, 1), ("1 1 1 1", 1, 3), ("2", 2, 0)],  # bad input (2) is not started again
)
def test_a_failed_step_is_started_again(codes, code, restarts, tmp_path):
    """Up to MAX_RESTARTS (3) more steps, each resuming the newest checkpoint."""
    proc = _script(GPU_TASKS, codes, tmp_path)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == code, err
    said = [f"plait: the step failed (exit 1); restart {n}/3" for n in range(1, restarts + 1)]
    assert err.splitlines() == said
    runs = _calls(tmp_path, "srun")
    assert len(runs) == len(codes.split())
    assert all("--dp auto" in r and r.endswith("--resume latest") for r in runs)
    assert _calls(tmp_path, "scontrol") == []


@pytest.mark.parametrize("script", [GPU_TASKS, NODE_TORCHRUN])
def test_the_time_limits_sigterm_reaches_srun_and_requeues(script, tmp_path):
    """SIGTERM to the script alone (`--signal=B:TERM@120`): srun gets it, the script waits for
    srun to end (the ranks' save), does not restart, requeues the job and exits 143."""
    proc = _script(script, "wait 0", tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143, err
    assert len(_calls(tmp_path, "srun")) == 1
    assert _calls(tmp_path, "scontrol")[-1] == "scontrol requeue 4242"
    if script == NODE_TORCHRUN:
        assert "--rdzv-endpoint node07:29500" in _calls(tmp_path, "srun")[0]
