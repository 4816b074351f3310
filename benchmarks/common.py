"""Shared helpers for the side-by-side benchmarks: timing, process groups, machine facts.

Benchmarks are not tests: they measure, print a markdown table and optionally save JSON.
Every benchmark alternates plait and the PyTorch reference inside one process (group), so
slow drift of the machine (other jobs, thermal state) hits both sides alike.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# ---------------------------------------------------------------- timing
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) without numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of one call (perf_counter) and its result."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def summarize(times_s: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and count of a list of step times, in milliseconds."""
    ms = [t * 1e3 for t in times_s]
    return {
        "median_ms": median(ms),
        "p25_ms": quantile(ms, 0.25),
        "p75_ms": quantile(ms, 0.75),
        "min_ms": min(ms) if ms else float("nan"),
        "steps": len(ms),
    }


def ratio_of_medians(a: Sequence[float], b: Sequence[float]) -> float:
    return median(a) / median(b)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of per-round ratios a[i] / b[i] (rounds alternate, so pairs share conditions)."""
    return median([x / y for x, y in zip(a, b, strict=True)])


# ---------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine() -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, OS, Python and torch."""
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gloo": dist.is_gloo_available(),
    }


def threads_for(world: int) -> int:
    """Each rank's share of the cores, so ranks don't oversubscribe them."""
    return max(1, usable_cores() // max(1, world))


# ---------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_for(world))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
        dist.barrier()  # nobody tears down gloo while a peer still talks to it
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args: Any) -> Any:
    """Run fn(rank, world, *args) on `world` gloo ranks (127.0.0.1, a free port); rank 0's
    JSON-serializable return value comes back. `fn` must be importable (module level).

    A failing rank's traceback is raised here by torch.multiprocessing.
    """
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, world, free_port(), out_dir, args),
            nprocs=world,
            start_method="spawn",
        )
        return json.loads(Path(out_dir, "result.json").read_text())


def max_over_ranks(value: float) -> float:
    """The largest value over the world (an all-reduce MAX; keep it outside timed regions)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---------------------------------------------------------------- output
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"saved {path}")


def describe_machine_md(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu']}, {m['cores']} usable cores, {m['os']}, "
        f"Python {m['python']}, torch {m['torch']}"
    )
