"""The two sides of `bench_pp.py`, for each of its two modes, and torch's compute log.

Real model: plait's `Trainer.train_step()` with `parallel.pp = world`, against the same
pruned model driven by `torch.distributed.pipelining` plus the rest of the Trainer's step
done by hand. Fixed-cost stages: plait's `PipelineRuntime` against torch's schedules over the
same stand-in stages (no optimizer on either side).

Every side records, besides its step times, what the measured bubble and the simulator need:
the pipeline part of each step, the compute records of this rank (plait's own runtime
`timings`; torch's from `TorchActionLog`), their totals per kind and chunk, and the compute
order of its first step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

import common
from plait.build.model import build_model
from plait.comm import Comm
from plait.data import GlobalBatchSampler
from plait.mesh import build_mesh
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.adamw import AdamW
from plait.parallel.grads import tied_embedding_params
from plait.parallel.pipeline.stage import prune_to_stages
from plait.parallel.pipeline.walker import PipelineRuntime
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions
from plait.schedule.actions import Action, Kind, TimedAction
from plait.schedule.schedules import build_schedule
from plait.schedule.stages import rank_plans
from plait.topology import Layout
from plait.train import Trainer
from pp_config import chunks_for, make_config
from pp_models import FixedModel, TorchStage, lm_loss

TORCH_SCHEDULE = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,  # one stage per rank: ZB-H1 (same_compute_order)
}
MULTI = {"interleaved", "zb-h1"}  # torch classes that take a list of stages


# ---------------------------------------------------------------- torch action log
class TorchActionLog:
    """Wall-clock start/end of every compute call of this rank's torch stages, as plait
    TimedAction records (chunk = the stage's local index), so `measure` applies unchanged."""

    def __init__(self, stages: list[PipelineStage], rank: int, p: int) -> None:
        self.rank = rank
        self.records: list[TimedAction] = []
        for stage in stages:
            chunk = stage.stage_index // p
            self._wrap(stage, "forward_one_chunk", Kind.F, chunk)
            self._wrap(stage, "backward_one_chunk", Kind.B, chunk)
            self._wrap(stage, "backward_weight_one_chunk", Kind.W, chunk)

    def _wrap(self, stage: PipelineStage, name: str, kind: Kind, chunk: int) -> None:
        inner = getattr(stage, name)
        log = self.records

        def timed(mb, *args, **kwargs):
            start = time.time()
            out = inner(mb, *args, **kwargs)
            log.append(
                TimedAction(self.rank, len(log), Action(kind, mb, chunk), start, time.time())
            )
            return out

        setattr(stage, name, timed)

    def reset(self) -> None:
        self.records.clear()


def torch_pipeline(
    model: nn.Module,
    plans: list,
    schedule: str,
    n_stages: int,
    m: int,
    group: Any,
    loss: Callable[..., torch.Tensor],
) -> tuple[list[PipelineStage], Any]:
    """This rank's stages as PipelineStages and torch's schedule over them, with plait's
    accumulation rule on text windows: each micro-batch's mean loss / m, `scale_grads=False`."""
    stages = [
        PipelineStage(
            TorchStage(model, plan), plan.stage, n_stages, torch.device("cpu"), group=group
        )
        for plan in plans
    ]

    def loss_fn(out, targets):
        return loss(out, targets) / m

    cls = TORCH_SCHEDULE[schedule]
    runs = stages if schedule in MULTI else stages[0]
    return stages, cls(runs, m, loss_fn=loss_fn, scale_grads=False)


# ---------------------------------------------------------------- sides
def compute_only(timings: list[TimedAction]) -> list[TimedAction]:
    return [t for t in timings if t.action.is_compute]


def kind_totals(timings: list[TimedAction]) -> list[tuple[str, float, int]]:
    """(key, total seconds, count): key 'F.c' / 'B.c' / 'W.c' for compute on chunk c, and
    'comm' for communication batches (a batch's actions share one start/end: counted once)."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    seen = set()
    for t in timings:
        if t.action.is_compute:
            key = f"{t.action.kind.value}.{t.action.chunk}"
        elif t.action.is_comm:
            if (t.start, t.end) in seen:
                continue
            seen.add((t.start, t.end))
            key = "comm"
        else:
            continue
        sums[key][0] += t.duration
        sums[key][1] += 1
    return [(k, v[0], v[1]) for k, v in sums.items()]


class Side(common.Side):
    """One pipeline implementation running one schedule, with what the bubble needs."""

    def __init__(self, name: str, schedule: str) -> None:
        super().__init__(name)
        self.schedule = schedule
        self.pipe_times: list[float] = []  # the pipeline part of the step, max over ranks
        self.bubbles: list[float] = []
        self.kind_sums: dict[str, float] = defaultdict(float)  # this rank, recorded steps
        self.kind_counts: dict[str, int] = defaultdict(int)
        self.last_timings: list[TimedAction] = []  # this rank, last step
        self.compute_order: list[str] = []  # this rank, first step

    def step(self) -> float:
        """One step; returns the seconds of its pipeline part (this rank)."""
        raise NotImplementedError

    def timings(self) -> list[TimedAction]:
        """This rank's compute (and, for plait, communication) records of the last step."""
        raise NotImplementedError

    def record(self, seconds: float, extra: Mapping[str, Any]) -> None:
        """Keep one recorded step: its time, its pipeline part, its measured bubble (from all
        ranks' compute extent and busy time) and this rank's action totals."""
        ext, busy, mine = extra["extent"], extra["busy"], extra["timings"]
        makespan = float(ext[0] + ext[1])
        p = dist.get_world_size()
        self.times.append(seconds)
        self.pipe_times.append(extra["pipe"])
        self.bubbles.append(1.0 - float(busy) / (p * makespan))
        for kind, total, n in kind_totals(mine):
            self.kind_sums[kind] += total
            self.kind_counts[kind] += n
        self.last_timings = list(mine)


class PlaitTrainerSide(Side):
    """plait as a user runs it: Trainer.train_step() with parallel.pp = world."""

    def __init__(self, schedule: str, opts, corpus, world: int) -> None:
        super().__init__("plait", schedule)
        self.cfg = make_config(schedule, opts, world)
        mesh = build_mesh(self.cfg.parallel.layout, torch.device("cpu"))
        self.trainer = Trainer(self.cfg, mesh, corpus)
        engine = self.trainer.pipeline
        run = engine.run

        def timed_run(micro):  # the pipeline part: runtime + loss all-reduce
            start = time.perf_counter()
            out = run(micro)
            self._pipe = time.perf_counter() - start
            return out

        engine.run = timed_run
        self._pipe = 0.0

    def step(self) -> float:
        res = self.trainer.train_step()
        self.losses.append(res.loss)
        return self._pipe

    def timings(self) -> list[TimedAction]:
        return self.trainer.pipeline.runtime.timings


class TorchRealSide(Side):
    """torch.distributed.pipelining over the same pruned model, plus the Trainer's step work."""

    def __init__(self, schedule: str, opts, corpus, world: int, rank: int, groups) -> None:
        super().__init__("torch", schedule)
        cfg = make_config(schedule, opts, world)
        self.cfg, self.corpus, self.rank, self.p = cfg, corpus, rank, world
        v = chunks_for(schedule, opts)
        plans = rank_plans(cfg.model.n_layers, world, v, rank, cfg.parallel.stage_layer_counts())
        self.model = build_model(
            cfg.model, torch.device("cpu"), cfg.train.seed, lambda m: prune_to_stages(m, plans)
        )
        self.pp_group, self.ends_group = groups
        loss = getattr(self.model, "loss", None) or lm_loss
        self.stages, self.sched = torch_pipeline(
            self.model, plans, schedule, world * v, cfg.accumulation, self.pp_group, loss
        )
        self.log = TorchActionLog(self.stages, rank, world)
        self.is_last = any(plan.last for plan in plans)
        self.opt = build_optimizer(self.model, cfg.optim)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.tied = tied_embedding_params(self.model)
        self.sampler = GlobalBatchSampler(len(corpus.train), cfg.train.global_batch, cfg.train.seed)
        self.step_i = 0

    def step(self) -> float:
        """The Trainer's step by hand around torch's schedule: lr, pipeline, tied-embedding
        gradient sum, global-norm clip (squared norms summed over stages, the tied matrix
        counted once), AdamW, loss all-reduce."""
        t = self.cfg.train
        x, y = self.corpus.train.batch(self.sampler.next_batch())
        set_lr(self.opt, lr_at(self.step_i, self.cfg.optim, t.steps))
        self.log.reset()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        self.sched.step(x, target=y, losses=losses)
        pipe = time.perf_counter() - start
        mean_loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
        for p in self.tied:  # Megatron's embedding group: first and last stage sum the copies
            dist.all_reduce(p.grad, group=self.ends_group)
        grads = [p.grad for p in self.params if p.grad is not None]
        # torch's private foreach kernels, as `clip_grad_norm_` runs them (its public form,
        # `nn.utils.get_total_norm`, returns the norm, not the sum of squares summed over pp)
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        if self.is_last and self.tied and self.p > 1:
            sq -= self.tied[-1].grad.pow(2).sum()  # the first stage counts the shared matrix
        dist.all_reduce(sq, group=self.pp_group)
        if self.cfg.optim.grad_clip > 0:
            coef = torch.clamp(self.cfg.optim.grad_clip / (sq.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(mean_loss, group=self.pp_group)  # only the last stage is nonzero
        self.losses.append(float(mean_loss))
        self.step_i += 1
        return pipe

    def timings(self) -> list[TimedAction]:
        return list(self.log.records)


def fixed_stages(schedule: str, opts, world: int, rank: int) -> tuple[FixedModel, list, int]:
    """This rank's part of the fixed-cost stand-in (pruned to its stages), the stage plans
    and v: `--layers-per-stage` blocks per stage, `--fixed-cost` ms forward per stage."""
    v = chunks_for(schedule, opts)
    n_layers = world * v * opts.layers_per_stage
    plans = rank_plans(n_layers, world, v, rank)
    cost = opts.fixed_cost / 1e3 / (v * opts.layers_per_stage)
    model = FixedModel(n_layers, opts.d_model, cost, opts.cost_mode)
    prune_to_stages(model, plans)
    return model, plans, v


class PlaitFixedSide(Side):
    """plait's PipelineRuntime over the fixed-cost stand-in (no optimizer)."""

    def __init__(self, schedule: str, opts, world: int, rank: int, micro) -> None:
        super().__init__("plait", schedule)
        self.model, plans, v = fixed_stages(schedule, opts, world, rank)
        self.sched = build_schedule(schedule, world, opts.microbatches, v)
        mesh = build_mesh(Layout(pp=world), torch.device("cpu"))
        comm = Comm(mesh)
        self.dp = ZeroEngine(self.model, comm, AdamW(), ZeroOptions(stage=0))  # never steps
        shape = (opts.micro_batch, opts.seq_len, opts.d_model)
        self.runtime = PipelineRuntime(self.sched, rank, self.model, plans, comm, self.dp, shape)
        self.micro = micro

    def step(self) -> float:
        start = time.perf_counter()
        loss = self.runtime.run(self.micro)
        self.dp.finish()
        self.dp.zero_grad()
        self.losses.append(float(loss))
        return time.perf_counter() - start

    def timings(self) -> list[TimedAction]:
        return self.runtime.timings


class TorchFixedSide(Side):
    """torch.distributed.pipelining over the same fixed-cost stand-in stages (no optimizer)."""

    def __init__(self, schedule: str, opts, world: int, rank: int, micro, group) -> None:
        super().__init__("torch", schedule)
        self.model, plans, v = fixed_stages(schedule, opts, world, rank)
        self.stages, self.sched = torch_pipeline(
            self.model, plans, schedule, world * v, opts.microbatches, group, self.model.loss
        )
        self.log = TorchActionLog(self.stages, rank, world)
        self.group = group
        self.x = torch.cat([mb.tokens for mb in micro])
        self.y = torch.cat([mb.targets for mb in micro])

    def step(self) -> float:
        self.log.reset()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        self.sched.step(self.x, target=self.y, losses=losses)
        for p in self.model.parameters():
            p.grad = None
        elapsed = time.perf_counter() - start
        self.losses.append(float(sum(float(v.detach()) for v in losses)) if losses else 0.0)
        return elapsed

    def timings(self) -> list[TimedAction]:
        return list(self.log.records)
