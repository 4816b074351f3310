"""Start the workers of a run: adopt a launcher's world (torchrun's or srun's, read by
`plait.launcher_env`), or spawn local processes.

Local runs spawn dp*pp*tp processes with torch.multiprocessing (start method 'spawn'), each
limited to its share of the CPU cores. If any worker raises, the others are terminated, the
failing rank's traceback is shown, and the launcher exits non-zero: no orphan survives.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console

from plait import faults
from plait.checkpoint.store import latest
from plait.config import Config
from plait.device import backend_for, resolve_device, threads_per_worker
from plait.errors import NonFiniteError
from plait.launcher_env import from_environment
from plait.mesh import Mesh, build_mesh
from plait.run import run
from plait.signals import Stopping, blocked, forward_of, pause_at, stopping_raised, unblock
from plait.telemetry import RunSummary

ATTEMPT_ENV = "PLAIT_ATTEMPT"
"""Which start of the world this is (0: the first), set by the launcher for its workers."""


def attempt() -> int:
    """This world's start: torchrun's restart count under torchrun, else the launcher's
    (`launch` counts its starts in ATTEMPT_ENV; a worker inherits it). The run's summary
    reports it, and each start keys its rendezvous and stop agreement afresh."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ATTEMPT_ENV) or 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(cfg: Config, rank: int, world: int, local_rank: int, local_world: int):
    """Join the process group and build this rank's mesh."""
    torch.set_num_threads(threads_per_worker(local_world))
    device = resolve_device(cfg.train.device, local_rank)
    store = None
    if world > 1:  # the store is kept for the mesh: the stop agreement uses it (`mesh.store`)
        timeout = datetime.timedelta(seconds=cfg.parallel.comm_timeout)
        store = _attempt_store(rank, world, timeout)
        dist.init_process_group(
            backend_for(device), store=store, rank=rank, world_size=world, timeout=timeout
        )
    return build_mesh(cfg.parallel.layout, device, cfg.parallel.comm_timeout, store)


def training_run(cfg: Config, mesh: Mesh) -> RunSummary:
    """The workers' default work: a training run, given the test fault `PLAIT_FAULT` asks of
    this rank. The variable is read once, here; without it the run has no hook at all."""
    start = attempt()
    return run(cfg, mesh, hook=faults.from_env(mesh.rank, start), attempt=start)


class Interrupted(Exception):
    """The run ended on a signal: after a step and a checkpoint, or at once (`forced`)."""

    def __init__(self, signum: int, forced: bool = False) -> None:
        self.signum, self.forced = signum, forced
        super().__init__(f"stopped by signal {signum}")


class WorkerFailure(RuntimeError):
    """A local worker failed; carries the rank that failed first and its traceback, and
    `line`: the one-line reason when plait diagnosed it (a NonFiniteError), else None."""

    def __init__(self, rank: int, trace: str, others: list[int], line: str | None = None) -> None:
        self.rank, self.trace, self.others, self.line = rank, trace, others, line
        also = f" (then ranks {others} failed too)" if others else ""
        super().__init__(f"rank {rank} failed first{also}:\n{trace}")


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store (MASTER_ADDR/MASTER_PORT), with keys of this start of the world
    only. torchrun shares its own store with the workers and keeps it across restarts, so
    without the prefix a restarted rank reads a dead peer's address and cannot connect
    (pytorch/pytorch#135712; seen here with gloo under `torchrun --max-restarts`)."""
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return dist.PrefixStore(f"plait/attempt-{attempt()}", store)


def worker(
    rank: int,
    cfg: Config,
    world: int,
    local_world: int,
    port: int | None,
    error_dir: str | None = None,
    target: Callable[[Config, Any], Any] = training_run,
    local_rank: int | None = None,
) -> Any:
    """Entry point of one spawned or adopted worker; `target(cfg, mesh)` is the work (a
    training run; `plait lessons` passes its own measuring run, a module-level function).
    A spawned worker's local rank is its rank (one machine)."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = rank if local_rank is None else local_rank
    try:
        # Until a run can stop after a step (its own StopRequest), a signal stops this worker
        # at once; spawned, it waited blocked (`_run_world`) until this handler was set.
        with stopping_raised(then=signal.SIG_IGN if port is not None else None):
            unblock()
            pause_at("rendezvous", f"rank{rank}")  # a test's signal comes after this line
            mesh = init_worker(cfg, rank, world, local_rank, local_world)
            return target(cfg, mesh)
    except Stopping as e:  # an Exception for torch's spawn, which ignores KeyboardInterrupt
        raise Interrupted(e.signum, forced=True) from None
    except BaseException as e:
        if error_dir is not None:  # the launcher picks the earliest failure: the root cause
            record = {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}
            record["line"] = str(e) if isinstance(e, NonFiniteError) else None
            Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_failure(error_dir: str, fallback: Exception) -> WorkerFailure:
    """When one rank dies its peers fail next (closed connections): report the first.

    A rank that ended without a Python exception (killed, `os._exit`) writes no record, but
    torch saw its process end first (`fallback`, a ProcessExitedException): it is the root
    cause, and the records are its peers' reactions (gloo's closed connection). The one
    diagnosis for a run that stops and one that restarts."""
    records = [json.loads(p.read_text()) for p in Path(error_dir).glob("rank*.json")]
    records.sort(key=lambda r: r["time"])
    dead = getattr(fallback, "error_index", -1)
    unrecorded = all(r["rank"] != dead for r in records)
    if not records or (isinstance(fallback, mp.ProcessExitedException) and unrecorded):
        return WorkerFailure(dead, str(fallback), [r["rank"] for r in records])
    first = records[0]
    others = [r["rank"] for r in records[1:]]
    return WorkerFailure(first["rank"], first["traceback"], others, first.get("line"))


def launch(cfg: Config, target: Callable[[Config, Any], Any] = training_run) -> None:
    """Run `cfg` on every worker it needs; raises WorkerFailure naming the first failing rank.

    torch.multiprocessing terminates the surviving workers as soon as one fails, so no
    process outlives the launcher.
    """
    adopted = from_environment()
    if adopted is not None:  # torchrun restarts the world itself; srun a batch script's loop
        cfg.parallel.layout.check_world(adopted.world)
        with _exported(adopted.rendezvous_env()):
            summary = worker(adopted.rank, cfg, adopted.world, adopted.local_world, None, None,
                             target, adopted.local_rank)  # fmt: skip
        stopped = getattr(summary, "stopped_by", None)
        if adopted.launcher == "slurm" and stopped is not None:
            # srun's exit code is the task's: a batch script tells a preempted run (143) from
            # a failed one (restart it) and a finished one. torchrun's agent would take a
            # non-zero worker for a failure and restart it: there the worker ends with 0.
            raise Interrupted(stopped)
        return
    restarts = cfg.train.max_restarts
    try:
        for start in range(restarts + 1):
            os.environ[ATTEMPT_ENV] = str(start)  # workers inherit it: the summary counts them
            try:
                _run_world(cfg, target)
                return
            except WorkerFailure as failure:
                if start == restarts or failure.line:  # a diverged run would diverge again
                    raise
                _say_restart(failure, start + 1, restarts, Path(cfg.log.out))
                ckpt = dataclasses.replace(cfg.checkpoint, resume="latest")
                cfg = dataclasses.replace(cfg, checkpoint=ckpt)
    finally:  # the launcher's own environment is as it was (a caller may launch again)
        os.environ.pop(ATTEMPT_ENV, None)


@contextmanager
def _exported(variables: dict[str, str]) -> Iterator[None]:
    """`variables` in this process's environment while the worker runs (srun's rendezvous
    for torch's env://), the environment as it was afterwards."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _say_restart(failure: WorkerFailure, n: int, of: int, out: Path) -> None:
    where = latest(out)
    start = f"from {where}" if where else "from step 0 (no checkpoint yet)"
    Console(stderr=True, soft_wrap=True).print(
        f"plait: rank {failure.rank} failed ({failure.trace.strip().splitlines()[-1]}); "
        f"restart {n}/{of} {start}",
        markup=False,
        highlight=False,
    )


def _run_world(cfg: Config, target: Callable[[Config, Any], Any]) -> None:
    """One world from start to end; WorkerFailure names the first rank that failed."""
    world = cfg.parallel.layout.world_size
    if world == 1:
        try:
            summary = worker(0, cfg, 1, 1, None, None, target)
        except Interrupted:
            raise
        except NonFiniteError as e:
            raise WorkerFailure(0, traceback.format_exc(), [], str(e)) from None
        except Exception:
            raise WorkerFailure(0, traceback.format_exc(), []) from None
        if getattr(summary, "stopped_by", None) is not None:
            raise Interrupted(summary.stopped_by)
        return
    with tempfile.TemporaryDirectory(prefix="plait-errors-") as error_dir:
        received: list[int] = []
        with blocked():  # the workers start blocked; what reaches plait meanwhile waits too
            ctx = mp.start_processes(
                worker,
                args=(cfg, world, world, free_port(), error_dir, target),
                nprocs=world,
                start_method="spawn",
                join=False,
            )
            previous = _pass_signals_on(ctx, received)
        try:
            pause_at("spawn", "launcher")  # a test's signal comes after this line
            with quiet_termination():
                while not ctx.join():
                    pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if received:  # a worker the signal ended before it could stop after a step
                raise Interrupted(received[0], forced=True) from None
            raise _first_failure(error_dir, e) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for name in ctx.error_files:  # torch leaves a failed worker's file in the temp dir
                Path(name).unlink(missing_ok=True)
        if received:
            raise Interrupted(received[0])


def _pass_signals_on(ctx: mp.ProcessContext, received: list[int]) -> dict:
    """SIGINT or SIGTERM to the launcher: ask every worker to stop after its step (SIGUSR1 or
    SIGUSR2, so that the worker names the signal);
    a second one ends them at once. Returns the handlers it replaced."""

    def handle(signum: int, frame: object) -> None:
        if received:
            stop_all(ctx)
            raise Interrupted(signum, forced=True)
        received.append(signum)
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, forward_of(signum))
        pause_at("forwarded", "launcher")  # a test's second signal comes after this line

    return {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}


_SPAWN_LOG = "torch.multiprocessing.spawn"
_TERMINATING = "Terminating process %s via signal SIGTERM"


def _not_terminating(record: logging.LogRecord) -> bool:
    return record.msg != _TERMINATING


@contextmanager
def quiet_termination() -> Iterator[None]:
    """Drop torch's "Terminating process N via signal SIGTERM" warnings while plait waits on
    its workers: when one fails, torch ends the others and logs a line for each, which buries
    the failing rank's traceback under noise about workers plait meant to stop. Only that
    message, by its text; every other torch warning still shows."""
    log = logging.getLogger(_SPAWN_LOG)
    log.addFilter(_not_terminating)
    try:
        yield
    finally:
        log.removeFilter(_not_terminating)


def stop_all(ctx: mp.ProcessContext, grace_s: float = 10.0) -> None:
    """Terminate the workers still running and wait for them, so none outlives the launcher."""
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()
