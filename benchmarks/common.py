"""Shared scaffolding of the side-by-side benchmarks: timing, sides and block alternation,
process groups, collective byte counts and machine facts (`output.py` formats the results).

Benchmarks are not tests: they measure, print a markdown table and optionally save JSON.
Every benchmark alternates plait and the PyTorch reference inside one process (group), so
slow drift of the machine (other jobs, thermal state) hits both sides alike. That protocol
lives here once (`Side`, `run_block`, `alternate`), so every benchmark times the same way.
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
from collections.abc import Callable, Hashable, Mapping, Sequence
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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (all_gather_object): for figures kept per rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def synthetic_batches(
    seed: int, n: int, batch: int, seq_len: int, vocab: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` random-token (x, y) batches of (batch, seq_len), y = x shifted by one: data that
    costs nothing to make, so both sides of a pair can train on exactly the same batches."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (n, batch, seq_len + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


# ---------------------------------------------------------------- sides and blocks
# One step of a side: (its figure in seconds, what `Side.record` keeps besides).
StepFn = Callable[[Any], tuple[float, Mapping[str, Any]]]


class Side:
    """What a block run keeps of one implementation under test, in every benchmark.

    Subclasses add the model and the step; the block runner below needs only these lists,
    so plait and its torch peer are recorded by the same code in every benchmark."""

    def __init__(self, name: str, phases: Sequence[str] = ()) -> None:
        self.name = name
        self.times: list[float] = []  # seconds per recorded step (max over ranks, if several)
        self.block_medians: list[float] = []  # one per recorded block, for paired ratios
        self.phases: dict[str, list[float]] = {p: [] for p in phases}  # this rank, recorded
        self.losses: list[float] = []  # this rank's loss, every step (warm-up included)

    def record(self, seconds: float, extra: Mapping[str, Any]) -> None:
        """Keep one recorded step: its figure and its per-phase times (`extra`)."""
        self.times.append(seconds)
        for k, v in extra.items():
            self.phases[k].append(v)

    def times_ms(self) -> list[float]:
        """Every recorded step in ms: the JSON keeps them so others can re-derive figures."""
        return [t * 1e3 for t in self.times]

    def phase_medians_ms(self) -> dict[str, float]:
        """Median of each phase over the recorded steps, in ms (this rank's clock)."""
        return {k: median(v) * 1e3 for k, v in self.phases.items()}


def run_block(side: Side, steps: int, record: bool, step: StepFn) -> None:
    """`steps` steps of one side; recorded ones are kept, and the block's median."""
    block = []
    for _ in range(steps):
        seconds, extra = step(side)
        if record:
            side.record(seconds, extra)
            block.append(seconds)
    if record:
        side.block_medians.append(median(block))


def warm_up(sides: Sequence[Side], steps: int, step: StepFn, interleave: bool = False) -> None:
    """Unrecorded steps: a block of `steps` per side in turn, or (`interleave`) one step of
    each side at a time."""
    if not interleave:
        for side in sides:
            run_block(side, steps, False, step)
        return
    for _ in range(steps):
        for side in sides:
            run_block(side, 1, False, step)


def alternate(
    pairs: Sequence[tuple[Side, Side]],
    step: StepFn,
    *,
    warmup: int,
    rounds: int,
    steps: int,
    interleave_warmup: bool = False,
) -> None:
    """Warm-up, then `rounds` rounds of one recorded block of `steps` steps per side, pairs
    taking turns inside a round and each pair's order flipping every round: slow drift of
    the machine then hits both sides of a pair alike."""
    warm_up([s for pair in pairs for s in pair], warmup, step, interleave_warmup)
    for r in range(rounds):
        for a, b in pairs:
            for side in (a, b) if r % 2 == 0 else (b, a):
                run_block(side, steps, True, step)


def cycled_step(batches: Sequence[Any], unpack: bool = True) -> StepFn:
    """The step of a side whose `run_step(batch)` returns its phase times. A side's step i
    uses batch i mod pool, so both sides see the same sequence. Timed on every rank; the
    figure is the max over ranks, taken outside the timed region (an all-reduce that also
    lines the ranks up before the next step). `unpack`: call run_step(*batch)."""

    def step(side: Any) -> tuple[float, Mapping[str, Any]]:
        batch = batches[len(side.losses) % len(batches)]
        args = batch if unpack else (batch,)  # before the clock: only run_step is timed
        start = time.perf_counter()
        phases = side.run_step(*args)
        return max_over_ranks(time.perf_counter() - start), phases

    return step


def step_figures(side: Side) -> dict[str, Any]:
    """A side's step-time summary, this rank's phase medians and every step time (ms)."""
    return {
        **summarize(side.times),
        "phases_median_ms": side.phase_medians_ms(),
        "times_ms": side.times_ms(),
    }


def pair_ratios(a: Side, b: Side, per_block: bool = False) -> dict[str, Any]:
    """a/b by median step and by the median of per-round (paired) block ratios; with
    `per_block`, every block ratio too."""
    out: dict[str, Any] = {
        "ratio_of_medians": ratio_of_medians(a.times, b.times),
        "paired_block_ratio": paired_ratio(a.block_medians, b.block_medians),
    }
    if per_block:
        pairs = zip(a.block_medians, b.block_medians, strict=True)
        out["block_ratios"] = [x / y for x, y in pairs]
    return out


def loss_diffs(a: Side, b: Side) -> list[float]:
    """|loss a - loss b| step by step over the steps both took: the check that both sides
    did the same work."""
    n = min(len(a.losses), len(b.losses))
    return [abs(x - y) for x, y in zip(a.losses[:n], b.losses[:n], strict=True)]


# ---------------------------------------------------------------- collective bytes
# Logical bytes follow plait.comm and the ZeRO paper: all-reduce and broadcast count the
# buffer, all-gather the output, reduce-scatter the input. Ops by name without namespace.
_FUNCOL_GATHERS = frozenset({"all_gather_into_tensor", "all_gather_into_tensor_coalesced"})
_INPUT_SECOND = frozenset(
    {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"}
)


def tensor_bytes(x: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors; anything else counts 0."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    return 0


def logical_bytes(op: str, args: tuple) -> int:
    """Logical bytes of one collective call, from its arguments; `op` is the op's name
    without namespace (c10d `allgather_`, funcol `all_gather_into_tensor`, ...)."""
    if op in _FUNCOL_GATHERS:
        return tensor_bytes(args[0]) * int(args[1])  # funcol: (input, group_size, group)
    if op in _INPUT_SECOND:
        return tensor_bytes(args[1])  # c10d reduce-scatter: (output, input, ...)
    return tensor_bytes(args[0])  # all-reduce, broadcast, c10d all-gather (output first), ...


def tally(table: dict[Any, dict[str, int]], key: Hashable, calls: int, nbytes: int) -> None:
    """Add calls and bytes under `key`: the {key: {"calls", "bytes"}} shape of every byte
    count the benchmarks report."""
    d = table.setdefault(key, {"calls": 0, "bytes": 0})
    d["calls"] += calls
    d["bytes"] += nbytes
