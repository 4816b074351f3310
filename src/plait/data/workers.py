"""Worker processes for `data prepare` that start whole and stop at once.

`concurrent.futures.ProcessPoolExecutor` cannot be stopped at once before Python 3.14: its
shutdown waits for the batches under way and for workers still importing, and its manager
thread can wait on a queue a killed worker left half read (a SIGTERM took up to 55 s; one
took 268 s here). A signal while it forks a worker through the forkserver could also leave a
worker whose parent never sent it its task, which printed an EOFError traceback after plait's
last line. So `data prepare` runs its own few processes, each with a pipe (no feeder or
manager thread between them): a task goes to the workers in turn, and each answers its own
tasks in order, so results come back in the order they were asked for.

- Every start runs with signals deferred and blocked (`plait.signals.deferred`, `blocked`):
  a signal is taken once the start is complete. The forkserver, and every worker it forks,
  inherit the blocked mask, so Ctrl-C to the group never reaches a worker; the parent ends
  them.
- Leaving on an error or a signal kills the workers (SIGKILL: they hold nothing to clean,
  they read pieces and return tokens) and waits only for them to be gone.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from plait.signals import blocked, deferred, pause_at


def _serve(conn: Any, initializer: Callable[[], None] | None) -> None:
    """A worker: run each task it is sent and send back (ok, result or exception)."""
    if initializer is not None:
        initializer()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent closed its end: nothing more to do
            return
        fn, args = task
        try:
            conn.send((True, fn(*args)))
        except Exception as e:  # the parent raises it where it reads the result
            conn.send((False, e))


class _Result(Future):
    """A task's result, read from its worker's pipe when first asked for (in order)."""

    def __init__(self, conn: Any, process: Any) -> None:
        super().__init__()
        self._conn, self._process = conn, process

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                ok, value = self._conn.recv()
            except EOFError:
                code = self._process.exitcode
                raise RuntimeError(f"a data prepare worker ended (exit code {code})") from None
            (self.set_result if ok else self.set_exception)(value)
        return super().result(timeout)


class Workers(Executor):
    """`count` worker processes (forkserver where there is one), each started on first use.
    Results must be read in the order tasks were submitted (`_Result`)."""

    def __init__(self, count: int, initializer: Callable[[], None] | None = None) -> None:
        methods = multiprocessing.get_all_start_methods()
        method = "forkserver" if "forkserver" in methods else "spawn"
        self._ctx = multiprocessing.get_context(method)
        if self._ctx.get_start_method() == "forkserver":
            # Nothing preloaded (not even __main__, the plait command): the server is up in a
            # moment, and each worker imports what it runs itself.
            self._ctx.set_forkserver_preload([])
        self._count, self._initializer = count, initializer
        self._workers: list[tuple[Any, Any]] = []  # (process, the parent's end of its pipe)
        self._next = 0

    def _start(self) -> tuple[Any, Any]:
        ours, theirs = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve, args=(theirs, self._initializer))
        with deferred(), blocked():
            process.start()
            pause_at("prepare-launch", "plait")  # a worker starting: a test's signal
        theirs.close()
        return process, ours

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        if kwargs:
            raise TypeError("Workers.submit takes positional arguments only")
        if len(self._workers) < self._count:
            self._workers.append(self._start())
        process, conn = self._workers[self._next % len(self._workers)]
        self._next += 1
        conn.send((fn, args))
        return _Result(conn, process)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the workers: at once (`cancel_futures`: SIGKILL, what is under way is lost),
        or once they have answered (closing their pipes ends their loop)."""
        for process, conn in self._workers:
            if cancel_futures:
                process.kill()
            conn.close()
        if wait:
            for process, _ in self._workers:
                process.join()
                process.close()
        self._workers = []

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(wait=True, cancel_futures=exc_type is not None)
