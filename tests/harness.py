"""Multi-rank test harness: start a gloo world once per test module, run many checks in it.

Starting processes and a process group costs seconds here, so a `World` keeps its workers
alive and feeds them functions (importable, module-level) to run on every rank. A check that
raises on any rank fails the test with that rank's traceback; a check that outlives its
timeout kills the world (the next check starts a fresh one) instead of hanging the suite.

Workers are forked from a fork server that imported torch and plait once for the whole
session (`multiprocessing`'s 'forkserver' start method with a preload): a fresh interpreter
per worker ('spawn') spent seconds of every world's start importing them again. Each world
is still new processes, none sharing state with the test process or an earlier world (the
server itself never runs torch: it only imports).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from plait.cli.dispatch import COMMANDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# every command's module (plait.cli.dispatch imports one only when its command runs), which
# import the rest of plait; the checkpoint library plait imports at the first save
PRELOAD = [
    "harness", "torch", "torch.distributed", "torch.distributed.checkpoint",
    *dict.fromkeys(f"plait.cli.{module}" for module, _, _ in COMMANDS.values()),
]  # fmt: skip


def _context() -> mp.context.BaseContext:
    """The fork server's context; the first call (per test session) names what it preloads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _serve(rank: int, world: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    results.put((rank, True, "ready"))
    while True:  # until `World.close` kills the process
        fn, args, kwargs = tasks.get()
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


class RankFailure(AssertionError):
    """A check raised on some rank; the message carries that rank's traceback."""


class World:
    """`n` worker processes joined in one gloo process group."""

    def __init__(self, n: int, start_timeout: float = 120.0) -> None:
        self.n = n
        self.start_timeout = start_timeout
        self._procs: list[mp.Process] = []
        self._start()

    def _start(self, tries: int = 3) -> None:
        """Start the workers and join them in one group. `_free_port` closes its socket before
        rank 0's store binds the port, so another process (the other xdist worker's world,
        a gloo connection's ephemeral port) can take it meanwhile; rank 0 then dies at
        start-up and the world is started again on a fresh port."""
        for attempt in range(tries):
            try:
                return self._launch()
            except RankFailure:
                if attempt == tries - 1:
                    raise

    def _launch(self) -> None:
        ctx = _context()
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.n)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, self.n, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.n)
        ]
        for p in self._procs:
            p.start()
        self._collect(self.start_timeout, "start-up")

    def run(self, fn: Callable, *args: Any, timeout: float = 180.0, **kwargs: Any) -> list:
        """Run fn(*args, **kwargs) on every rank; returns the results in rank order."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", str(fn)))

    def _collect(self, timeout: float, what: str) -> list:
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_failure = 0.0
        while len(out) + len(failures) < self.n:
            if failures:  # survivors may be stuck in a collective: give them 10 s to report
                deadline = min(deadline, first_failure + 10.0)
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if failures and time.monotonic() > deadline:
                    break
                if dead or time.monotonic() > deadline:
                    self.close()
                    missing = sorted(set(range(self.n)) - set(out) - set(failures))
                    reason = f"ranks {dead} died" if dead else f"timed out after {timeout:g}s"
                    raise RankFailure(f"{what}: {reason}; no answer from ranks {missing}") from None
                continue
            if not ok and not failures:
                first_failure = time.monotonic()
            (out if ok else failures)[rank] = value
        if failures:
            self.close()
            first = min(failures)
            raise RankFailure(f"{what} failed on rank {first}:\n{failures[first]}")
        return [out[r] for r in range(self.n)]

    def close(self) -> None:
        """End the workers. They are idle between checks (or stuck) and hold nothing to keep,
        so they are killed: a graceful exit (process group torn down, torch unloaded) costs
        seconds per world here and proves nothing."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
