"""`plait train`: the run's flags, validated before anything starts, then the launcher.

Everything that can be checked before a worker starts is checked here (the config, the
checkpoint to resume, the output folder); then `plait.launch` starts the workers and this
module turns how they ended into an exit code.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from rich.console import Console

from plait.checkpoint.base import folder_sha256
from plait.checkpoint.store import check_resumable, latest, resolve
from plait.cli.run_flags import add_run_flags, config_from_args
from plait.config import config_warnings
from plait.device import check_gpu_per_rank, host_available_bytes
from plait.errors import ConfigError, print_bad_input
from plait.estimate.host import check_run_host_memory
from plait.launch import Interrupted, WorkerFailure, launch
from plait.launcher_env import from_environment
from plait.outdir import check_out_folder, prepare_out
from plait.signals import exit_code


def add_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train a model (spawns dp workers unless under torchrun)")
    add_run_flags(train)


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        cfg = config_from_args(args)
        if cfg.model.lora and cfg.checkpoint.init_from:  # once, here: the checkpoints name the base
            cfg.checkpoint.init_from_sha256 = folder_sha256(Path(cfg.checkpoint.init_from))
        out = Path(cfg.log.out)
        start = resolve(cfg.checkpoint.resume, out) if cfg.checkpoint.resume else None
        if start is not None:
            check_resumable(start, cfg.to_dict())
        launched = from_environment()  # torchrun's or srun's ranks: this node's count
        node = launched.node_ranks() if launched else range(cfg.parallel.layout.world_size)
        check_gpu_per_rank(cfg.train.device, len(node))
        check_run_host_memory(cfg, node, host_available_bytes())
        if cfg.memory.offload_dir:  # else each rank's NVMe store fails alone
            check_out_folder(Path(cfg.memory.offload_dir), "--offload-dir")
        if launched is None or launched.rank == 0:  # one rank owns the folder
            prepare_out(out, cfg.log.overwrite, bool(cfg.checkpoint.resume))
    except ConfigError as e:
        return print_bad_input(err, e)
    for line in config_warnings(cfg):
        err.print(f"[yellow]plait: warning:[/] {line}", highlight=False)
    try:
        launch(cfg)
    except WorkerFailure as e:
        if e.line:  # diagnosed (a non-finite loss): the reason, without a traceback
            err.print(f"plait: error: {e.line}", markup=False, highlight=False)
            return 1
        err.print("[bold red]plait: a worker failed; all ranks stopped.[/]")
        err.print(str(e), markup=False, highlight=False)
        return 1
    except Interrupted as e:
        if e.forced:  # what is on disk now, not what this run had meant to write
            err.print(f"[bold]plait: stopped at once; every rank ended, {_kept(out)}.[/]")
        return exit_code(e.signum)
    except KeyboardInterrupt as e:  # `Stopping` (SIGTERM) included
        err.print("[bold]plait: interrupted; every rank stopped.[/]")
        return exit_code(getattr(e, "signum", signal.SIGINT))
    return 0


def _kept(out: Path) -> str:
    """The newest committed checkpoint a forced stop leaves: a second Ctrl-C after a save
    committed it (while the summary was written) must not say there is none."""
    newest = latest(out, warn=False)
    if newest is None:
        return "no checkpoint"
    return f"newest checkpoint {newest}; continue with --resume latest --out {out}"
