"""The two sides of `bench_zero.py` and the two instruments that measure them.

Sides: plait's `ZeroEngine` at one stage, and the PyTorch implementation compared with it
(FSDP2 `fully_shard`, `ZeroRedundancyOptimizer` over DDP, or DDP with AdamW), each behind
one step protocol that times its phases the same way.

Instruments, used only in untimed steps because both run Python on every op:
- `CollectiveCounter`, a TorchDispatchMode that adds up the logical bytes of every c10d
  collective it sees, on either side. The same ruler for both, checked against plait's own
  `CommStats` on the plait side.
- torch's `MemTracker` (`FSDPMemTracker` for FSDP2), also for both sides. plait's flat
  buffers exist before the tracker starts, so they are registered with their category.

Private torch APIs, here rather than in `plait.torch_private` because they measure torch, not
train: the memory trackers live only under `torch.distributed._tools` (no public memory
tracker by category exists; `torch.cuda.memory` reports totals only, and not on CPU), and
plait's buffers reach their categories only through `MemTracker._update_and_maybe_create_winfos`
and `_MemRefType`. `TorchDispatchMode` is torch's documented way to intercept every op,
though it is imported from `torch.utils._python_dispatch`. A torch upgrade that moves them
breaks this benchmark, never training.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import common
from common import logical_bytes, max_over_ranks, median, tally, tensor_bytes
from plait.comm import Comm
from plait.config import OptimConfig
from plait.optim import build_optimizer
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules, clip_coef
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions

PHASES = ("forward", "backward", "finish", "clip", "step", "zero")
Probe = Callable[[], None] | None


class Side(common.Side):
    """One implementation's model, optimizer and step; subclasses name themselves."""

    def __init__(self, model: nn.Module, opts: Any, train_cfg: OptimConfig) -> None:
        super().__init__("?", PHASES)
        self.model, self.clip, self.lr = model, opts.clip, train_cfg.lr

    def run_step(self, x: Tensor, y: Tensor, probe: Probe = None) -> dict[str, float]:
        """One optimizer step; `probe()` runs after the update, before grads are zeroed."""
        raise NotImplementedError

    def memory_tracker(self) -> MemTracker:
        raise NotImplementedError


class PlaitSide(Side):
    """`ZeroEngine` at `stage`, driven exactly as `plait.step.Step` drives it."""

    def __init__(self, stage: int, model: nn.Module, comm: Comm, opts: Any, cfg: OptimConfig):
        super().__init__(model, opts, cfg)
        self.name, self.comm = f"plait ZeRO-{stage}", comm
        options = ZeroOptions(stage=stage, bucket_mb=opts.bucket_mb)
        self.engine = ZeroEngine(model, comm, AdamW.from_optim(cfg), options)
        self.rules = SplitGradRules.of(model, comm.mesh)
        self.count_activations = False  # the engine's own activation meter, untimed steps only

    def run_step(self, x: Tensor, y: Tensor, probe: Probe = None) -> dict[str, float]:
        e, clock = self.engine, time.perf_counter
        t0 = clock()
        self.comm.stats.begin_step(len(self.losses))
        e.begin_step()
        e.micro_batch(is_last=True)
        meter = e.memory.activations() if self.count_activations else nullcontext()
        with meter:
            loss = self.model(x, y)
            t1 = clock()
            e.scale_loss(loss).backward()
        t2 = clock()
        e.finish()
        t3 = clock()
        if self.clip > 0:
            e.clip(clip_coef(e.grad_norm(self.rules), self.clip))
        t4 = clock()
        e.step(self.lr)
        t5 = clock()
        if probe:
            probe()
        t5p = clock()
        e.zero_grad()
        t6 = clock()
        self.losses.append(float(loss.detach()))
        return dict(
            forward=t1 - t0, backward=t2 - t1, finish=t3 - t2, clip=t4 - t3, step=t5 - t4,
            zero=t6 - t5p,
        )  # fmt: skip

    def memory_tracker(self) -> MemTracker:
        """MemTracker with the engine's buffers registered under their categories.

        Parameters are views of flat buffers (stage 3: of storage resized to zero between
        uses), so tracking the model tracks the buffers. Shards, gradient buffers and Adam
        moments are registered through MemTracker's own (private) registration so that they
        land in Parameter / Gradient / Optstate rather than Other. The fp32 master weight is
        the parameter shard itself (no copy), so it is not registered twice."""
        mt = MemTracker()
        mt.track_external(self.model)
        e = self.engine
        groups = (
            (_MemRefType.PARAM, e.params.shards),
            (_MemRefType.GRAD, [t for t in e.grads.full if t is not None] + e.grads.shards),
            (_MemRefType.OPT, [t for s in e.states.states for k, t in s.items() if k != "master"]),
        )
        for reftype, tensors in groups:
            for t in tensors:
                mt._update_and_maybe_create_winfos(t, reftype)
        return mt

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """plait's own accounting of the last step: op -> calls and logical bytes."""
        out: dict[str, dict[str, int]] = {}
        for r in self.comm.stats.records.values():
            tally(out, r.op, r.calls, r.bytes)
        return out


def torch_adamw(model: nn.Module, cfg: OptimConfig, foreach: bool) -> torch.optim.AdamW:
    """plait's AdamW groups and hyper-parameters (`build_optimizer`). On CPU torch picks the
    per-parameter loop; `foreach` asks for its multi-tensor path instead."""
    opt = build_optimizer(model, cfg)
    for group in opt.param_groups:
        group["foreach"] = True if foreach else None
    return opt


class TorchSide(Side):
    """A torch model (wrapped or sharded) with a torch optimizer; clip with clip_grad_norm_."""

    def __init__(self, model: nn.Module, opts: Any, cfg: OptimConfig) -> None:
        super().__init__(model, opts, cfg)
        self.module = model  # what is called: the DDP wrapper for the DDP sides
        self.opt: torch.optim.Optimizer | None = None

    def run_step(self, x: Tensor, y: Tensor, probe: Probe = None) -> dict[str, float]:
        clock = time.perf_counter
        t0 = clock()
        loss = self.module(x, y)
        t1 = clock()
        loss.backward()  # DDP and FSDP2 wait for their last reduction in here
        t2 = clock()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        t3 = clock()
        self.opt.step()
        t4 = clock()
        if probe:
            probe()
        t4p = clock()
        self.opt.zero_grad(set_to_none=True)
        t5 = clock()
        self.losses.append(float(loss.detach()))
        return dict(
            forward=t1 - t0, backward=t2 - t1, finish=0.0, clip=t3 - t2, step=t4 - t3,
            zero=t5 - t4p,
        )  # fmt: skip


class FsdpSide(TorchSide):
    """FSDP2: each transformer block its own `fully_shard` unit, then the root."""

    def __init__(
        self, model: nn.Module, mesh: DeviceMesh, reshard: bool, opts: Any, cfg: OptimConfig
    ) -> None:
        super().__init__(model, opts, cfg)
        self.name = f"FSDP2 reshard_after_forward={reshard}"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        if opts.fsdp_prefetch:
            explicit_prefetch(model)
        self.opt = torch_adamw(model, cfg, opts.foreach)  # DTensor parameters

    def memory_tracker(self) -> MemTracker:
        """FSDP2's own tracker: it knows sharded/unsharded parameters and comm buffers."""
        return FSDPMemTracker(self.model, self.opt)


def explicit_prefetch(model: nn.Module) -> None:
    """Ask FSDP2 to start the next unit's all-gather when one starts, as plait's Gatherer
    does. By default FSDP2 relies on CUDA streams running behind the CPU for overlap,
    which a CPU device does not have."""
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i])


class DdpSide(TorchSide):
    """DDP with torch AdamW (`zero_opt=False`) or with ZeroRedundancyOptimizer(AdamW)."""

    def __init__(self, model: nn.Module, zero_opt: bool, opts: Any, cfg: OptimConfig) -> None:
        super().__init__(model, opts, cfg)
        self.module = DDP(
            model, bucket_cap_mb=opts.bucket_mb, gradient_as_bucket_view=opts.ddp_grad_view
        )
        self.buckets: list[Tensor] = []  # set by measure_comm
        if zero_opt:
            self.name = "DDP + ZeroRedundancyOptimizer(AdamW)"
            decay = [p for p in model.parameters() if p.dim() >= 2]
            rest = [p for p in model.parameters() if p.dim() < 2]
            self.opt = ZeroRedundancyOptimizer(
                [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest}],
                optimizer_class=torch.optim.AdamW,
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
                eps=1e-8,
                weight_decay=0.0,
                foreach=True if opts.foreach else None,
                parameters_as_bucket_view=opts.zero_bucket_view,
            )
        else:
            self.name = "DDP + AdamW"
            self.opt = torch_adamw(model, cfg, opts.foreach)

    def memory_tracker(self) -> MemTracker:
        """MemTracker with the model, the optimizer(s) and DDP's gradient buckets registered.

        DDP allocates its flat buckets in C++ (no dispatched op creates them), so MemTracker
        would first see them when backward all-reduces them, after the forward's peak. The
        buckets were captured by `measure_comm` (the tensors DDP all-reduced) and are
        registered here up front, as Other."""
        mt = MemTracker()
        inner = getattr(self.opt, "optim", None)  # ZeroRedundancyOptimizer's local AdamW
        mt.track_external(self.model, self.opt, *([inner] if inner is not None else []))
        mt.track_external(*self.buckets)
        return mt


# ---------------------------------------------------------------- instruments
# op name -> the kind it is counted under; its logical bytes are common.logical_bytes.
_COLLECTIVES = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_reduce_": "all_reduce",
    "_c10d_functional::broadcast": "broadcast",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
}


_COMM_WORDS = ("reduce", "gather", "scatter", "broadcast", "all_to_all", "alltoall", "send",
               "recv", "barrier")  # fmt: skip


class CollectiveCounter(TorchDispatchMode):
    """Calls and logical bytes of every collective dispatched while active.

    Exact for what goes through the dispatcher (c10d ops, including those DDP's C++ reducer
    and FSDP2 issue, and DTensor's functional collectives, which are seen after DTensor
    desugars them). Unknown communication ops are recorded under their name with the bytes
    of all their tensor arguments, and flagged, rather than dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, int]] = {}
        self.unknown: set[str] = set()
        self.all_reduced: list[Tensor] = []  # DDP's buckets: registered with MemTracker later

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        name = func._schema.name
        if name.startswith(("c10d::", "_c10d_functional::")) and any(
            w in name for w in _COMM_WORDS
        ):
            self._record(name, args)
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, args: tuple) -> None:
        if name in _COLLECTIVES:
            kind, nbytes = _COLLECTIVES[name], logical_bytes(name.split("::", 1)[1], args)
            if name == "c10d::allreduce_":
                self.all_reduced += list(args[0])
        elif "barrier" in name:
            kind, nbytes = "barrier", 0
        else:
            kind, nbytes = name, tensor_bytes(list(args))
            self.unknown.add(name)
        tally(self.ops, kind, 1, nbytes)


def measure_comm(side: Side, x: Tensor, y: Tensor) -> dict[str, Any]:
    """One untimed step under the counter; plait's own CommStats of that step as well."""
    counter = CollectiveCounter()
    with counter:
        side.run_step(x, y)
    out: dict[str, Any] = {"counted": counter.ops, "unknown_ops": sorted(counter.unknown)}
    if isinstance(side, DdpSide):
        side.buckets = [t for t in counter.all_reduced if t.numel() > 1]  # not the clip norm
    if isinstance(side, PlaitSide):
        out["plait_comm_stats"] = side.comm_stats()
    return out


def collective_times(numel: int, reps: int = 12) -> dict[str, float]:
    """Median ms (max over ranks) of each gloo collective alone on a Ψ-sized fp32 buffer:
    what each stage's traffic costs on this machine without a model around it. The ops take
    turns, so drift of the machine hits them alike; the first two rounds are dropped."""
    world = dist.get_world_size()
    numel -= numel % world
    full, shard = torch.zeros(numel), torch.zeros(numel // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "broadcast": lambda: dist.broadcast(full, 0),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(max_over_ranks(time.perf_counter() - start))
    return {name: median(t[2:]) * 1e3 for name, t in times.items()}


def _plain(snapshot: dict) -> dict[str, int]:
    """MemTracker's {device: {reftype: bytes}} for the CPU as {category name: bytes}."""
    dev = next(iter(snapshot.values()), {})
    return {(k.value if isinstance(k, Enum) else str(k)): int(v) for k, v in dev.items()}


def measure_memory(side: Side, x: Tensor, y: Tensor) -> dict[str, Any]:
    """One untimed step under torch's MemTracker: the peak (with its breakdown) and the state
    right after the optimizer update, when parameters, gradients and moments all exist."""
    mt = side.memory_tracker()
    after: dict[str, int] = {}
    if isinstance(side, PlaitSide):
        side.count_activations = True
    with mt, warnings.catch_warnings():
        # plait's gradient hook runs before MemTracker's and has already moved p.grad into
        # its bucket, so MemTracker's post-accumulate hook finds None and warns; harmless
        # (its pre-accumulate hook saw the gradient).
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        side.run_step(x, y, probe=lambda: after.update(_plain(mt.get_tracker_snapshot())))
    out: dict[str, Any] = {"after_step": after, "peak": _plain(mt.get_tracker_snapshot("peak"))}
    if isinstance(side, PlaitSide):
        side.count_activations = False
        out["plait_tracker"] = side.engine.memory.report()
    if isinstance(side, DdpSide):
        out["ddp_bucket_bytes"] = tensor_bytes(side.buckets)
    return out
