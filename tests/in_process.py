"""`plait train` inside the test process, its ranks on a harness world (no tests here).

`plait train ARGS` parses and validates the flags, checks a checkpoint to resume and the
output folder, then launches the workers, each of which runs `launch.training_run`.
`train(world, args)` runs that same `plait.cli.main`, with its launch (in `plait.cli.train`)
replaced by the same per-rank call on the ranks of a harness `World` (started once per
module): everything but the launcher, without seconds of process start-up per run;
`evaluate(world, args)` does the same for `plait eval` (its worker is `evaluate.eval_worker`).
tests/test_launch.py tests the launcher itself (spawned workers, signals, failures,
restarts, torchrun).
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import plait.cli.evaluate as eval_command
import plait.cli.train as train_command
from harness import World
from plait.cli import main
from plait.config import Config
from plait.device import resolve_device, threads_per_worker
from plait.launch import training_run
from plait.mesh import build_mesh

TINY = [
    "--model", "tiny-gpt", "--dp", "2", "--steps", "4", "--seq-len", "32",
    "--global-batch", "4", "--micro-batch", "1", "--eval-batches", "1", "--eval-every", "2",
    "--max-bytes", "200000", "--no-progress",
]  # fmt: skip
"""The flags of a tiny dp2 run of a few seconds (tests override any of them after)."""


def _rank_run(cfg: Config, store_file: str, target: Callable = training_run) -> str:
    """One rank's run (`target(cfg, mesh)`: a training run, or `plait eval`'s worker), set up
    as `launch.init_worker` sets up a launched worker (its share of the cores, its device, a
    key-value store for the stop agreement: a file store here, as the harness world's own is
    not handed out); returns what it printed on stderr."""
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(world))
    device = resolve_device(cfg.train.device, rank)
    store = dist.FileStore(store_file, world)
    mesh = build_mesh(cfg.parallel.layout, device, cfg.parallel.comm_timeout, store)
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            target(cfg, mesh)
    finally:
        torch.set_num_threads(threads)
    return err.getvalue()


def train(world: World, args: list[str]) -> tuple[int, str]:
    """`plait train ARGS` with `world`'s ranks as its workers: the exit code, and stderr
    (the command's own lines, then each rank's)."""
    printed: list[str] = []

    def launch(cfg: Config) -> None:
        with tempfile.TemporaryDirectory(prefix="plait-test-store-") as folder:
            printed.extend(world.run(_rank_run, cfg, str(Path(folder, "store"))))

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stderr(err):
        patch.setattr(train_command, "launch", launch)
        code = main(["train", *args])
    return code, err.getvalue() + "".join(printed)


def evaluate(world: World, args: list[str]) -> tuple[int, str, str]:
    """`plait eval ARGS` with `world`'s ranks as its workers: the exit code, stdout (what the
    command printed), and stderr (the command's own lines, then each rank's)."""
    printed: list[str] = []

    def launch(cfg: Config, target: Callable) -> None:
        with tempfile.TemporaryDirectory(prefix="plait-test-store-") as folder:
            printed.extend(world.run(_rank_run, cfg, str(Path(folder, "store")), target))

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(out), redirect_stderr(err):
        patch.setattr(eval_command, "launch", launch)
        code = main(["eval", *args])
    return code, out.getvalue(), err.getvalue() + "".join(printed)
