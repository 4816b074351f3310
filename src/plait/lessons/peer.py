"""The peer in the data-parallel lesson: torch's DistributedDataParallel on the same model,
data, batch, seed and schedule as plait's data parallelism, so the lesson can set plait's
step time and loss next to PyTorch's own implementation.

This is the one place in plait that hands gradients to torch.distributed outside comm.py:
DDP is the thing being compared, and it talks to the process group itself (its buckets are
reduced by its C++ reducer during the backward). Wrapping it would change what is measured,
so it runs as shipped: default all-reduce, `gradient_as_bucket_view=False`, plait's bucket
size. Everything else goes through plait: the launcher starts the world, the mesh gives the
dp group, the loss is averaged through `Comm` (counted), the weights come from `build_model`
(layout-independent, so DDP's start-up broadcast changes nothing) and the batches from
`StepBatches`. The optimizer is torch's AdamW with plait's parameter groups and learning
rate schedule, clipped by `clip_grad_norm_`, as a torch user would write it.

Measured: loss and time per step, the loss all-reduce (Comm), optimizer states (the
optimizer's live moment tensors). Computed: the gradient all-reduce bytes, as the sum of
DDP's own bucket sizes (its logging data), since DDP all-reduces each bucket once per
synchronized step; its flat bucket buffers, the same sum, live for the whole run.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from plait.build.corpus import load_corpus
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import Config
from plait.data.batches import StepBatches
from plait.device import synchronize
from plait.lessons.measure import save_record
from plait.mesh import Mesh
from plait.optim import build_optimizer, lr_at, set_lr
from plait.torch_private import ddp_logging_data


def ddp_peer(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """Train `cfg.train.steps` steps with torch DDP; write and return the measure-style record."""
    if mesh.size("tp") > 1 or mesh.size("pp") > 1:
        raise ValueError("the DDP peer is pure data parallelism: tp = pp = 1")
    t = cfg.train
    comm = Comm(mesh)
    model = build_model(cfg.model, mesh.device, t.seed)
    ddp = DistributedDataParallel(
        model, process_group=mesh.group("dp"), bucket_cap_mb=cfg.parallel.bucket_mb
    )
    optimizer = build_optimizer(model, cfg.optim)
    replica = (mesh.coord.dp, mesh.size("dp"))
    batches = StepBatches(load_corpus(cfg), t.global_batch, t.micro_batch, t.seed, replica,
                          mesh.device, t.loss_average)  # fmt: skip
    steps = []
    for k in range(t.steps):
        comm.stats.begin_step(k)
        loss, seconds, grads = _step(k, ddp, optimizer, batches, comm, cfg)
        buckets = bucket_bytes(ddp)
        memory = {"gradients": grads, "optimizer_states": moment_bytes(optimizer),
                  "comm_buffers": sum(buckets)}  # fmt: skip
        steps.append(
            {
                "loss": loss,
                "time_s": seconds,
                "bytes": comm.stats.bytes_by_op(),  # the loss; DDP's gradients are not in Comm
                "ddp_bucket_bytes": buckets,
                "memory": {"peak": {"device": memory}},
            }
        )
    return save_record(cfg, mesh, steps)


def _step(k: int, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer,
          batches: StepBatches, comm: Comm, cfg: Config) -> tuple[float, float, int]:  # fmt: skip
    """One step as plait's (step.py) does it: accumulate the micro-batches (DDP reduces
    during the last one's backward), clip, step at the schedule's rate, average the loss.
    Returns the loss, the time and the gradients' bytes (before they are freed)."""
    t = cfg.train
    start = time.perf_counter()
    micro = batches.draw(k)
    n = len(micro)
    loss_sum = torch.zeros((), device=batches.device)
    for i, mb in enumerate(micro):
        sync = contextlib.nullcontext() if i == n - 1 else ddp.no_sync()
        with sync:
            # plait's loss rule: summed target losses / the global count (models/loss.py)
            loss = ddp(mb.tokens, mb.targets, mb.keys, segments=mb.segments, denom=mb.denom)
            loss.backward()
        loss_sum += loss.detach().float()
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.optim.grad_clip)
    set_lr(optimizer, lr_at(k, cfg.optim, t.steps))
    optimizer.step()
    grads = sum(p.grad.nbytes for p in ddp.parameters() if p.grad is not None)
    optimizer.zero_grad(set_to_none=True)
    mean = loss_sum  # this replica's share; the dp average is the global loss
    comm.all_reduce(mean, "dp", op="avg", tag="loss")
    synchronize(comm.mesh.device)
    return float(mean), time.perf_counter() - start, grads


def bucket_bytes(ddp: DistributedDataParallel) -> list[int]:
    """DDP's gradient buckets in bytes, from its logging data (rebuilt after the first step,
    in the order gradients became ready)."""
    data = ddp_logging_data(ddp)
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Adam's moments as the optimizer holds them (its per-parameter step counters left out:
    plait's engine keeps one count for all)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for name, v in state.items()
        if name in ("exp_avg", "exp_avg_sq")
    )
