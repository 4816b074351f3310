"""`plait calibrate`: measure this machine and write a hardware profile for `plait plan`.

N gloo processes (as `plait train` would start them, each with its share of the cores)
measure together, so every figure is what one rank sees while the others work too:
- peak FLOP/s: the best rate of a large fp32 matmul on every rank at once;
- achievable and pass overhead: a model's forward and backward (`--model`, `--seq-len`) at
  1 to 8 sequences, fitted as time = fixed + tokens x FLOPs per token (`matmul_flops_per_token`)
  / rate: the rate as a fraction of that peak, the fixed part per block (and head) pass;
- alpha and beta of all_reduce, all_gather, reduce_scatter over the whole world and over
  pairs (all pairs at once, as tensor-parallel groups run), each through `comm.py` over sizes
  from 4 KiB to 16 MiB, each call after a burst of compute on every rank (as a step makes
  them: `_computed`), and of one p2p message of the model's activation sizes sent while
  every rank computes (as in a pipeline's steady state: `_p2p`);
  least squares fits time = steps(op, n)·alpha + bytes·factor(op, n)/beta (plan/hardware.py);
- the optimizer's pass: the norm, clip, AdamW update and zero_grad of `Step`, through
  plait's own functions, on a flat fp32 shard of 2^20 elements on every rank at once
  (seconds per element: the step's optimizer term is this times the rank's shard);
- the pipeline runtime's own seconds per action: plait's 1F1B over every rank on a model
  with next to no FLOPs, solved through the simulator (`calibrate_runtime.py`);
- host bandwidth: a large tensor copy (what offload to the host costs on a CPU device);
  disk bandwidth: writing and reading back a file in the temporary folder.
One machine has one link class: `inter` copies `intra`, and the note says so. Computation and
gloo's threads share the cores, so `overlap` is 0; more ranks than cores share them
(`contention` = ranks x threads per rank / cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.calibrate_runtime import action_overhead, pipeline_step_seconds
from plait.comm import Comm
from plait.device import threads_per_worker
from plait.errors import ConfigError
from plait.launch import free_port, stop_all
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.models.transformer import Transformer, matmul_flops_per_token
from plait.outdir import check_out_file
from plait.parallel.adamw import AdamW
from plait.parallel.grads import squared_norm
from plait.plan.hardware import Hardware, Link, OpCost, ring_steps_and_factor, save_hardware
from plait.signals import blocked, exit_code, pause_at, unblock
from plait.topology import Layout

SIZES = [2**k for k in range(10, 23, 2)]  # fp32 elements: 4 KiB to 16 MiB
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
MICRO_BATCHES = (1, 2, 4, 8)  # sequences per forward when fitting rate and overhead
PROBE_MICRO, PROBE_BYTES = 4, 16 * 16 * 4  # the runtime probe: 4p micro-batches of (1, 16, 16)


def _median_time(fn, repeats: int, sync=None) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _computed(comm: Comm, seconds: float = 0.003) -> None:
    """Start a repeat the way a training step reaches a collective: together (a barrier),
    then after a burst of compute on every rank. Where ranks share cores, a rank that
    computed must be scheduled again and wake its peers' communication threads; a
    collective timed back to back misses that and comes out several times faster."""
    comm.barrier()
    _compute_until(time.time() + seconds)


def _compute_until(until: float, work: torch.Tensor | None = None) -> None:
    work = torch.randn(128, 128) if work is None else work
    while time.time() < until:
        work @ work


def _flops(args: argparse.Namespace, comm: Comm) -> dict:
    """The peak (a large matmul) and a model's forward + backward at several micro-batch
    sizes, fitted as time = passes·overhead + tokens·FLOPs per token / rate."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    barrier = comm.barrier  # every rank starts each repeat together
    peak = 2 * n**3 / _median_time(lambda: a @ b, args.repeats, barrier)
    arch = get_preset(args.model)
    model = Transformer(arch)
    tokens, seconds = [], []
    for mb in MICRO_BATCHES:
        x = torch.randint(0, arch.vocab_size, (mb, args.seq_len))
        seconds.append(_median_time(partial(_forward_backward, model, x), args.repeats, barrier))
        tokens.append(x.numel())
    fixed, per_token = _relative_lstsq([[1.0, t] for t in tokens], seconds)
    rate = matmul_flops_per_token(arch, args.seq_len) / per_token
    passes = 3 * (arch.n_layers + 1)  # F, B and W of every block and of the head
    return {"peak": peak, "achievable": rate / peak, "overhead": max(0.0, fixed) / passes}


def _optimizer_s_per_element(comm: Comm, repeats: int, n: int = 2**20) -> float:
    """Seconds per shard element of what a step does after the reduction (step.py): the
    float64 norm, the clip factor applied as the gradient is read, AdamW, zero_grad."""
    master, grad = torch.randn(n), torch.randn(n)
    adam = AdamW(weight_decay=0.1)
    states = {name: torch.zeros(n) for name in adam.state_names}

    def step() -> None:
        coef = 1.0 / float(squared_norm([grad], grad.device).sqrt().clamp(min=1.0))
        adam.update(master, grad.to(torch.float32) * coef, states, 1, 1e-4, [(0, n)])
        grad.zero_()  # the values do not change the cost of element-wise kernels

    return _median_time(step, repeats, comm.barrier) / n


def _forward_backward(model: Transformer, x: torch.Tensor) -> None:
    model(x, x).backward()


def _collectives(comm: Comm, repeats: int) -> list[tuple[str, int, int, float]]:
    """(op, ranks, logical bytes, seconds) for each op, group and size."""
    rows = []
    axes = ["world"] + (["tp"] if comm.mesh.size("tp") > 1 else [])
    for axis in axes:
        n = comm.mesh.size(axis)
        for size in SIZES:
            full, part = torch.ones(size * n), torch.ones(size)
            ops = {
                "all_reduce": partial(comm.all_reduce, full, axis),
                "all_gather": partial(comm.all_gather, full, part, axis),
                "reduce_scatter": partial(comm.reduce_scatter, part, full, axis),
            }
            for op, fn in ops.items():
                seconds = _median_time(fn, repeats, partial(_computed, comm))
                rows.append((op, n, full.numel() * 4, seconds))
    return rows


def _p2p(comm: Comm, args: argparse.Namespace) -> list[tuple[str, int, int, float]]:
    """One pipeline message as a pipeline sees it: rank 0 posts it in the middle of its own
    compute and computes on, rank 1 waits for it, every other rank computes throughout.
    Where ranks share cores the receiver must be scheduled again before the message lands,
    which costs far more than the wire (an idle ping-pong misses it). Sizes: the model's
    activation at 1 to 8 sequences, the messages its pipeline sends. Seconds from the send
    to the receiver holding it (one clock: one machine), the median of the repeats."""
    arch = get_preset(args.model)
    rows = []
    for mb in MICRO_BATCHES:
        nbytes = mb * args.seq_len * arch.d_model * 4
        took = torch.zeros(args.repeats, dtype=torch.float64)
        for i in range(args.repeats):
            took[i] = _message_under_load(comm, nbytes)
        comm.all_reduce(took, "world")  # rank 1's figures, to rank 0 which writes them
        rows.append(("p2p", 2, nbytes, float(took.median())))
    return rows


def _message_under_load(comm: Comm, nbytes: int, window: float = 0.04) -> float:
    """One message of `nbytes` while the world computes (see `_p2p`); rank 1 returns its
    latency, the others 0."""
    work = torch.randn(128, 128)
    msg = torch.zeros(nbytes // 8, dtype=torch.float64)  # float64: the send time fits in it
    compute = partial(_compute_until, work=work)
    comm.barrier()
    start, latency = time.time(), 0.0
    if comm.mesh.rank == 0:
        compute(start + window / 8)
        msg[0] = time.time()
        sent = comm.p2p([("send", msg, 1)], "world")
        compute(start + window)
        sent.wait()
    elif comm.mesh.rank == 1:
        comm.p2p([("recv", msg, 0)], "world").wait()
        latency = time.time() - float(msg[0])
        compute(start + window)
    else:
        compute(start + window)
    return latency


def _bandwidths() -> dict:
    src = torch.ones(2**24)  # 64 MiB
    dst = torch.empty_like(src)
    host = src.numel() * 4 / _median_time(lambda: dst.copy_(src), 5)
    data = src.numpy().tobytes()
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as d:
        path = Path(d, "probe.bin")
        t = time.perf_counter()
        with path.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _ = path.read_bytes()
        disk = 2 * len(data) / (time.perf_counter() - t)
    return {"host": host, "disk": disk}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    # Ctrl-C reaches the whole process group: the parent alone decides (it stops every
    # worker), so that no rank leaves the others waiting in a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock()  # started blocked (`run_calibrate`): a SIGTERM that waited ends this worker now
    pause_at("calibrate", f"rank{rank}")  # a test's Ctrl-C comes after this line
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_worker(world))
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        tp = 2 if world % 2 == 0 and world > 2 else 1
        comm = Comm(build_mesh(Layout(dp=world // tp, tp=tp), torch.device("cpu")))
        torch.manual_seed(rank)
        result = {"flops": _flops(args, comm), "rows": _collectives(comm, args.repeats)}
        result["optimizer"] = _optimizer_s_per_element(comm, args.repeats)
        result["rows"] += _p2p(comm, args)
        result["pipeline"] = {"world": world, "m": PROBE_MICRO * world, "message": PROBE_BYTES}
        result["pipeline"]["step_s"] = pipeline_step_seconds(world, PROBE_MICRO * world)
        if rank == 0:
            result["bandwidth"] = _bandwidths()
            Path(out).write_text(json.dumps(result))
        comm.barrier()
    finally:
        dist.destroy_process_group()


def _relative_lstsq(x: list[list[float]], y: list[float]) -> list[float]:
    """Least squares of x·c = y in *relative* error (each row divided by its y), so the small
    sizes, where latency dominates, count as much as the large ones; no coefficient < 0."""
    a, b = np.array(x, dtype=float), np.array(y, dtype=float)
    w = 1 / b
    coef = np.linalg.lstsq(a * w[:, None], b * w, rcond=None)[0]
    if coef.min() >= 0:
        return [float(c) for c in coef]
    keep = coef > 0  # drop the negative term and refit the rest
    out = np.zeros_like(coef)
    out[keep] = np.linalg.lstsq(a[:, keep] * w[:, None], b * w, rcond=None)[0]
    return [float(max(c, 0.0)) for c in out]


def fit(rows: list[tuple[str, int, int, float]]) -> OpCost:
    """alpha and beta of time = steps·alpha + bytes·factor/beta, fitted in relative error."""
    feats = []
    for op, n, nbytes, _ in rows:
        steps, factor = ring_steps_and_factor(op, n)
        feats.append([float(steps), nbytes * factor])
    alpha, inv_beta = _relative_lstsq(feats, [r[3] for r in rows])
    return OpCost(alpha, 1 / max(inv_beta, 1e-30))


def profile_of(result: dict, world: int) -> Hardware:
    rows = result["rows"]
    link = Link({op: fit([r for r in rows if r[0] == op]) for op in (*COLLECTIVES, "p2p")})
    probe = result["pipeline"]
    message = link.time("p2p", 2, probe["message"])
    per_action = action_overhead(probe["step_s"], probe["world"], probe["m"], message)
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(
        name=f"this machine, {world} gloo ranks",
        peak_flops=result["flops"]["peak"],
        achievable=min(1.0, result["flops"]["achievable"]),
        memory=pages // world,
        host_bandwidth=result["bandwidth"]["host"],
        host_is_device=True,  # one machine: offloaded activations stay in the same RAM
        disk_bandwidth=result["bandwidth"]["disk"],
        intra=link,
        inter=link,
        precision="fp32",
        overlap=0.0,
        pass_overhead_s=result["flops"]["overhead"],
        contention=max(1.0, world * threads_per_worker(world) / _cores()),
        optimizer_s_per_element=result["optimizer"],
        action_overhead_s=per_action,
        note="measured by plait calibrate; one machine: inter copies intra; gloo shares "
        "the cores with compute, so overlap = 0; memory is the host's RAM / ranks",
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _interrupted(ctx: mp.ProcessContext, out: str, signum: int) -> int:
    stop_all(ctx)
    print(f"plait: calibrate interrupted; every rank stopped, {out} not written", file=sys.stderr)
    return exit_code(signum)


def run_calibrate(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        raise ConfigError(f"--ranks must be >= 2 (collectives need two ranks), got {args.ranks}")
    get_preset(args.model).check_seq_len(args.seq_len)
    check_out_file(Path(args.out))
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as d:
        out = str(Path(d, "result.json"))
        with blocked():  # a worker still importing must not take Ctrl-C as a traceback
            ctx = mp.start_processes(
                _worker,
                args=(args.ranks, free_port(), args, out),
                nprocs=args.ranks,
                start_method="spawn",
                join=False,
            )
        try:
            while not ctx.join():
                pass
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Stopping`, plait.cli.main)
            return _interrupted(ctx, args.out, getattr(e, "signum", signal.SIGINT))
        except mp.ProcessExitedException as e:
            if e.signal_name != "SIGTERM":
                raise
            return _interrupted(ctx, args.out, signal.SIGTERM)  # the group's, a worker first
        result = json.loads(Path(out).read_text())
    hw = profile_of(result, args.ranks)
    save_hardware(hw, args.out)
    print(
        f"wrote {args.out}: peak {hw.peak_flops / 1e9:.1f} GFLOP/s per rank, achievable "
        f"{hw.achievable:.2f}, all_reduce alpha {hw.intra.cost('all_reduce').alpha_s * 1e6:.0f} us "
        f"beta {hw.intra.cost('all_reduce').beta_bytes_per_s / 1e9:.2f} GB/s"
    )
    return 0
