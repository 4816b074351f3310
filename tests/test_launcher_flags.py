"""`plait train` under a launcher's variables, before any worker starts (no process): srun's
world must be the layout's, `--dp auto` fills the world and keeps the global batch, and each
refusal is one line with exit code 2. The variables are fabricated; the launch is replaced by
a function that keeps the config it was given."""

from __future__ import annotations

import os

import pytest

from plait.cli import main
from plait.config import Config

SLURM = {
    "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
    "SLURM_JOB_ID": "9", "SLURM_JOB_NAME": "train",
}  # fmt: skip
TORCHRUN_1 = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
BATCH = ["--global-batch", "16", "--micro-batch", "4", "--seq-len", "32", "--max-bytes", "60000"]


@pytest.fixture
def env(monkeypatch, tmp_path):
    """Set a launcher's variables (none of the test process's own kept); returns the configs
    the launch was given."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name in TORCHRUN_1 or name.startswith("MASTER_"):
            monkeypatch.delenv(name)
    launched: list[Config] = []
    monkeypatch.setattr("plait.cli.train.launch", launched.append)
    monkeypatch.chdir(tmp_path)

    def set_env(values: dict[str, str]) -> list[Config]:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        return launched

    return set_env


def one_line(argv: list[str], capsys) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err
    return err


def test_srun_world_must_be_the_layouts(env, capsys):
    env(SLURM)
    err = one_line(["--dp", "2", *BATCH], capsys)
    assert "srun's SLURM_NTASKS=4: world size 4 != dp*pp*tp = 2*1*1 = 2 (or give --dp auto)" in err


def test_dp_auto_fills_the_world_and_keeps_the_global_batch(env, tmp_path):
    """4 srun tasks with tp 2: dp 2, so the 16 sequences are 2 micro-batches of 4 per rank
    (as `--dp 2` gives), whether `auto` is a flag or a TOML value; world 1 (torchrun's
    variables): 4 of them."""
    launched = env(SLURM)
    assert main(["train", "--dp", "auto", "--tp", "2", *BATCH, "--out", "a"]) == 0
    (tmp_path / "auto.toml").write_text('[parallel]\ndp = "auto"\ntp = 2\n')
    assert main(["train", "--config", "auto.toml", *BATCH, "--out", "b"]) == 0
    env(TORCHRUN_1)
    assert main(["train", "--dp", "auto", *BATCH, "--out", "c"]) == 0
    shape = [(c.parallel.dp, c.parallel.tp, c.train.micro_batch, c.accumulation) for c in launched]
    assert shape == [(2, 2, 4, 2), (2, 2, 4, 2), (1, 1, 4, 4)]


REFUSED = [
    ({}, ["--dp", "auto"], "--dp auto takes dp from a launcher's world (torchrun, or srun with "
     "SLURM_NTASKS > 1), and none started this process; give --dp N to start N local workers"),
    (SLURM, ["--dp", "auto", "--tp", "3"], "--dp auto: srun's SLURM_NTASKS=4 is not a multiple "
     "of tp 3 x pp 1 = 3, so no dp fills it"),
    ({**SLURM, "SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "3"}, ["--dp", "auto"],
     "--dp auto: srun's SLURM_NTASKS=3 with tp 1 x pp 1 gives dp 3, but global batch 16 is not "
     "a multiple of micro-batch 4 x dp 3 = 12; the global batch is kept"),
    (SLURM, ["--dp", "4", "--max-restarts", "2"], "--max-restarts 2 under slurm: each process "
     "is one rank and cannot restart the world; restart it with srun again"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[1-"}, ["--dp", "4"],
     "SLURM_JOB_NODELIST='gpu[1-' is not a Slurm host list"),
]  # fmt: skip


@pytest.mark.parametrize("variables, argv, message", REFUSED)
def test_refused_in_one_line_before_workers(env, capsys, variables, argv, message):
    launched = env(variables)
    assert message in one_line([*argv, *BATCH], capsys)
    assert launched == []
