"""plait pipeline parallelism vs torch.distributed.pipelining: same stages, micro-batches, world.

Two modes, one process group of `--world` gloo ranks (one pipeline rank each, dp = tp = 1):

**Real model** (default). For every schedule, each rank builds

- plait: `plait.train.Trainer(cfg, mesh, corpus)` with `parallel.pp = world`,
  `parallel.schedule` and `parallel.virtual_stages`; one step is `Trainer.train_step()`
  (sampler, pipeline runtime, tied-embedding gradient sum, global-norm clip, AdamW, loss).
- torch: the *same* pruned model (`build_model` + `prune_to_stages` with the same
  `rank_plans`, so the same layers per stage and the same initial weights), each of this
  rank's stages wrapped in a small `TorchStage` module (embedding / kept blocks / final norm and
  head) and a `torch.distributed.pipelining.PipelineStage`, driven by `ScheduleGPipe`,
  `Schedule1F1B`, `ScheduleInterleaved1F1B` (2 stages per rank) or
  `ScheduleInterleavedZeroBubble` (1 stage per rank, which is ZB-H1; the executed compute order
  is checked equal to plait's `zb-h1`). The loss function is the model's own `LMLoss` divided by
  m with `scale_grads=False`, which is plait's accumulation rule. The rest of the step does
  what the Trainer does: same sampler and batches, same lr schedule, tied-embedding gradient
  all-reduce between the pipeline ends, global-norm clip (squared norms summed over stages,
  tied matrix counted once), AdamW from `plait.optim.build_optimizer`, loss all-reduce.

**Fixed-cost stages** (`--fixed-cost MS`). The model is a stand-in whose blocks take a fixed
wall time: forward MS/(v·L) per block, input-gradient backward the same, weight-gradient
backward the same (so backward = 2 × forward, split 1:1 between B and W, the simulator's
`Costs(f, b, w)` with f = b = w). The time is burnt by custom autograd Functions (sleep, then a
short spin to the deadline; `--cost-mode spin` spins throughout), so the pipeline's compute
cost is controlled and the measured bubble can be set next to the simulator's prediction.
plait runs `PipelineRuntime` directly (no Trainer: the stand-in is not a Transformer config),
torch runs the same stand-in stages through its schedules.

Timing: every rank times each step with perf_counter; the step figure is the max over ranks
(all-reduce MAX outside the timed region, which also lines the ranks up). After warm-up,
rounds alternate a block of `--steps` plait steps with a block of torch steps per schedule,
the order flipping every round, and the schedules taking turns inside a round.

Measured bubble (both sides, same definition as `plait.parallel.pipeline.simulate.measure`
applied to compute actions only): 1 − Σ_ranks compute time / (p × makespan), the makespan
running from the first compute start to the last compute end over all ranks. plait's compute
times are its runtime's own `timings`; torch's come from thin wrappers around the stage's
`forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk` (two clock reads per
call).

    .venv/bin/python benchmarks/bench_pp.py --json benchmarks/results/pp_real.json
    .venv/bin/python benchmarks/bench_pp.py --fixed-cost 10 --json benchmarks/results/pp_fixed.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plait
from common import machine, median, paired_ratio, spawn, summarize, threads_for
from output import describe_machine_md, markdown_table, save_json
from plait.comm import Comm
from plait.config import build_config
from plait.data import GlobalBatchSampler, load_tokens
from plait.mesh import build_mesh
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.data_parallel import DataParallel
from plait.parallel.pipeline.actions import Action, Kind, TimedAction
from plait.parallel.pipeline.runtime import MicroBatch, PipelineRuntime
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.simulate import Costs, measure, simulate
from plait.parallel.pipeline.stage import prune_to_stages, rank_plans, tied_embedding_params
from plait.topology import Layout
from plait.train import Trainer, build_model, corpus_from_tokens

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
TORCH_SCHEDULE = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,  # with one stage per rank: ZB-H1 (checked below)
}
MULTI = {"interleaved", "zb-h1"}  # torch classes that take a list of stages


def chunks_for(schedule: str, opts: argparse.Namespace) -> int:
    return opts.virtual_stages if schedule == "interleaved" else 1


# ---------------------------------------------------------------- torch stage modules
class TorchStage(nn.Module):
    """One global stage of a (pruned) plait model as a plain module for PipelineStage.

    Holds the very submodules plait's `run_stage` would call for this stage: the embedding on
    the first stage, the kept blocks, the final norm and head on the last (which returns
    logits; the schedule's loss_fn applies the model's own loss)."""

    def __init__(self, model: nn.Module, plan) -> None:
        super().__init__()
        self.first, self.last = plan.first, plan.last
        self.embed = model.embed if plan.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in plan.layers)
        self.norm = model.norm if plan.last else None
        self.head = model.head if plan.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)  # (b, s, h)
        for block in self.blocks:
            x = block(x)  # (b, s, h)
        return self.head(self.norm(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy in fp32 that `Transformer.output` computes (used where the
    model has no `loss` submodule)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- fixed-cost stand-in model
def burn(seconds: float, mode: str) -> None:
    """Take `seconds` of wall time: sleep (leaves the core to gloo) and spin the last 0.3 ms for
    precision, or spin throughout."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if mode == "sleep" and seconds > 3e-4:
        time.sleep(seconds - 3e-4)
    while time.perf_counter() < deadline:
        pass


class _InputPath(torch.autograd.Function):
    """Identity; forward costs `f`, backward (the input gradient) costs `b`."""

    @staticmethod
    def forward(ctx, x, f, b, mode):
        burn(f, mode)
        ctx.b, ctx.mode = b, mode
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        burn(ctx.b, ctx.mode)
        return g, None, None, None


class _WeightPath(torch.autograd.Function):
    """Broadcasts a scalar weight to `ref`'s shape; backward (the weight gradient) costs `w`."""

    @staticmethod
    def forward(ctx, weight, ref, w, mode):
        ctx.w, ctx.mode = w, mode
        return weight.expand(ref.shape).clone()

    @staticmethod
    def backward(ctx, g):
        burn(ctx.w, ctx.mode)
        return g.sum(), None, None, None


class FixedBlock(nn.Module):
    """x -> InputPath(x) + WeightPath(weight): F, B and W each take a fixed time. The input path
    does not lead to the weight, so a weight-only backward (ZB's W) of a one-block stage runs
    only the weight path, and an input-only backward (ZB's B) only the input path."""

    def __init__(self, f: float, b: float, w: float, mode: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.f, self.b, self.w, self.mode = f, b, w, mode

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        y = _InputPath.apply(x, self.f, self.b, self.mode)
        return y + _WeightPath.apply(self.weight, x.detach(), self.w, self.mode)


class FixedEmbed(nn.Module):
    """Tokens (b, s) -> activations (b, s, h) at no cost. Its scalar weight stands for the
    embedding matrix: stage 0's backward reaches a weight through the block's input path, as
    in the real model (where stage 0's gradient work lands in W under plait's ZB-H1)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, tokens: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        x = tokens.unsqueeze(-1).expand(*tokens.shape, self.d_model).float() * 1e-3
        return x * self.scale


class MeanLoss(nn.Module):
    def forward(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return out.float().mean()


class FixedModel(nn.Module):
    """The attributes plait's `run_stage`/`prune_to_stages` use: embed, blocks, norm, head,
    loss and output(x, targets)."""

    def __init__(self, n_layers: int, d_model: int, block_cost: float, mode: str) -> None:
        super().__init__()
        self.embed = FixedEmbed(d_model)
        self.blocks = nn.ModuleList(
            FixedBlock(block_cost, block_cost, block_cost, mode) for _ in range(n_layers)
        )
        self.norm = nn.Identity()
        self.head = nn.Identity()
        self.loss = MeanLoss()

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.head(self.norm(x))
        return out if targets is None else self.loss(out, targets)


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


# ---------------------------------------------------------------- sides
class Side:
    def __init__(self, name: str, schedule: str) -> None:
        self.name, self.schedule = name, schedule
        self.times: list[float] = []  # step seconds, max over ranks (recorded steps)
        self.pipe_times: list[float] = []  # the pipeline part of the step, max over ranks
        self.block_medians: list[float] = []
        self.losses: list[float] = []
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


def _compute_only(timings: list[TimedAction]) -> list[TimedAction]:
    return [t for t in timings if t.action.is_compute]


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
        m = cfg.accumulation
        self.stages = [
            PipelineStage(
                TorchStage(self.model, plan),
                plan.stage,
                world * v,
                torch.device("cpu"),
                group=self.pp_group,
            )
            for plan in plans
        ]
        loss = getattr(self.model, "loss", None) or lm_loss

        def loss_fn(logits, targets):  # plait's rule: each micro-batch's mean loss / m
            return loss(logits, targets) / m

        cls = TORCH_SCHEDULE[schedule]
        stages = self.stages if schedule in MULTI else self.stages[0]
        self.sched = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
        self.log = TorchActionLog(self.stages, rank, world)
        self.is_last = any(plan.last for plan in plans)
        self.opt = build_optimizer(self.model, cfg.train)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.tied = tied_embedding_params(self.model)
        self.sampler = GlobalBatchSampler(len(corpus.train), cfg.train.global_batch, cfg.train.seed)
        self.step_i = 0

    def step(self) -> float:
        t = self.cfg.train
        x, y = self.corpus.train.batch(self.sampler.next_batch())
        set_lr(self.opt, lr_at(self.step_i, t))
        self.log.reset()
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        self.sched.step(x, target=y, losses=losses)
        pipe = time.perf_counter() - start
        mean_loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
        for p in self.tied:  # Megatron's embedding group: first and last stage sum the copies
            dist.all_reduce(p.grad, group=self.ends_group)
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        if self.is_last and self.tied and self.p > 1:
            sq -= self.tied[-1].grad.pow(2).sum()  # the first stage counts the shared matrix
        dist.all_reduce(sq, group=self.pp_group)
        if t.grad_clip > 0:
            coef = torch.clamp(t.grad_clip / (sq.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.all_reduce(mean_loss, group=self.pp_group)  # only the last stage is nonzero
        self.losses.append(float(mean_loss))
        self.step_i += 1
        return pipe

    def timings(self) -> list[TimedAction]:
        return list(self.log.records)


class PlaitFixedSide(Side):
    """plait's PipelineRuntime over the fixed-cost stand-in (no optimizer)."""

    def __init__(self, schedule: str, opts, world: int, rank: int, micro) -> None:
        super().__init__("plait", schedule)
        v = chunks_for(schedule, opts)
        n_layers = world * v * opts.layers_per_stage
        self.sched = build_schedule(schedule, world, opts.microbatches, v)
        plans = rank_plans(n_layers, world, v, rank)
        cost = opts.fixed_cost / 1e3 / (v * opts.layers_per_stage)
        self.model = FixedModel(n_layers, opts.d_model, cost, opts.cost_mode)
        prune_to_stages(self.model, plans)
        mesh = build_mesh(Layout(pp=world), torch.device("cpu"))
        comm = Comm(mesh)
        self.dp = DataParallel(self.model, comm, 25.0)
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
        v = chunks_for(schedule, opts)
        n_layers = world * v * opts.layers_per_stage
        m = opts.microbatches
        plans = rank_plans(n_layers, world, v, rank)
        cost = opts.fixed_cost / 1e3 / (v * opts.layers_per_stage)
        self.model = FixedModel(n_layers, opts.d_model, cost, opts.cost_mode)
        prune_to_stages(self.model, plans)
        self.stages = [
            PipelineStage(
                TorchStage(self.model, plan),
                plan.stage,
                world * v,
                torch.device("cpu"),
                group=group,
            )
            for plan in plans
        ]
        loss = self.model.loss

        def loss_fn(out, targets):
            return loss(out, targets) / m

        cls = TORCH_SCHEDULE[schedule]
        stages = self.stages if schedule in MULTI else self.stages[0]
        self.sched = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
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


# ---------------------------------------------------------------- config and data
def make_config(schedule: str, opts, world: int):
    m = opts.microbatches
    train = {
        "steps": 10_000,  # only sets the lr schedule's length
        "micro_batch": opts.micro_batch,
        "global_batch": opts.micro_batch * m,
        "seq_len": opts.seq_len,
        "lr": opts.lr,
        "warmup_steps": 10,
        "eval_every": 0,
        "progress": False,
        "grad_clip": opts.clip,
        "seed": opts.seed,
        "out": "/tmp/plait-bench-pp-unused",
    }
    over = {
        "model": {"dropout": 0.0, "n_layers": opts.n_layers},
        "parallel": {
            "pp": world,
            "schedule": schedule,
            "virtual_stages": chunks_for(schedule, opts),
            "bucket_mb": opts.bucket_mb,
        },
        "data": {"max_bytes": opts.max_bytes},
        "train": train,
    }
    cfg = build_config(opts.model, over)
    cfg.validate(check_data=False)
    return cfg


def fixed_micro(opts) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(opts.seed)
    b, s = opts.micro_batch, opts.seq_len
    return [
        MicroBatch(
            torch.randint(0, 256, (b, s), generator=g),
            torch.randint(0, 256, (b, s), generator=g),
            torch.zeros(b, dtype=torch.int64),
        )
        for _ in range(opts.microbatches)
    ]


# ---------------------------------------------------------------- measuring
def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_block(side: Side, steps: int, record: bool) -> None:
    block = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe = side.step()
        elapsed = time.perf_counter() - start
        mine = side.timings()
        if not side.compute_order:
            side.compute_order = [f"{t.action.kind.value}{t.action.microbatch}.{t.action.chunk}"
                                  for t in _compute_only(mine)]  # fmt: skip
        # Outside the timed region: max over ranks, and each rank's compute extent and busy
        # time for the measured bubble (one all-reduce each; also a barrier).
        compute = _compute_only(mine)
        t = torch.tensor([elapsed, pipe], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ext = torch.tensor(
            [-min(c.start for c in compute), max(c.end for c in compute)], dtype=torch.float64
        )
        busy = torch.tensor([sum(c.duration for c in compute)], dtype=torch.float64)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        dist.all_reduce(busy)
        if record:
            makespan = float(ext[0] + ext[1])
            p = dist.get_world_size()
            side.times.append(float(t[0]))
            side.pipe_times.append(float(t[1]))
            side.bubbles.append(1.0 - float(busy) / (p * makespan))
            block.append(float(t[0]))
            for kind, total, n in _kind_totals(mine):
                side.kind_sums[kind] += total
                side.kind_counts[kind] += n
            side.last_timings = list(mine)
    if record:
        side.block_medians.append(median(block))


def _kind_totals(timings: list[TimedAction]):
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


def side_result(side: Side, rank_stats: list[dict]) -> dict:
    """Summary of one side; mean action durations per rank (all chunks) from every rank's
    totals over the recorded steps."""
    means = {}
    for r, st in enumerate(rank_stats):
        by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for key, total in st["sums"].items():
            if key != "comm":
                by_kind[key.split(".")[0]][0] += total
                by_kind[key.split(".")[0]][1] += st["counts"][key]
        means[f"rank{r}"] = {k: v[0] / v[1] * 1e3 for k, v in sorted(by_kind.items()) if v[1]}
        comm = st["sums"].get("comm", 0.0) / max(1, st["steps"])
        means[f"rank{r}"]["comm_ms_per_step"] = comm * 1e3
    return {
        **summarize(side.times),
        "pipeline_median_ms": median(side.pipe_times) * 1e3,
        "times_ms": [t * 1e3 for t in side.times],
        "bubble_median": median(side.bubbles),
        "bubbles": side.bubbles,
        "mean_action_ms": means,
    }


def stage_costs(rank_stats: list[dict], p: int, v: int, split: bool) -> Costs:
    """Mean measured F, B, W of every global stage (chunk·p + rank) over the recorded steps,
    as simulator costs. Where the backward is not split, B ran the whole backward: it is split
    evenly (as PipelineEngine.report does), which leaves b + w, the simulated B, unchanged."""
    costs = {k: [0.0] * (p * v) for k in "FBW"}
    for r, st in enumerate(rank_stats):
        for key, total in st["sums"].items():
            if key != "comm":
                kind, chunk = key.split(".")
                costs[kind][int(chunk) * p + r] = total / st["counts"][key]
    f, b, w = costs["F"], costs["B"], costs["W"]
    if not split:
        b, w = [x / 2 for x in b], [x / 2 for x in b]
    return Costs(f=f, b=b, w=w)


def p2p_latency(shape: tuple[int, ...], rounds: int = 30) -> float:
    """One-way time of one activation-sized message between ranks 0 and 1 (half the median
    ping-pong), seconds; the other ranks idle."""
    t = torch.zeros(shape)
    rank, times = dist.get_rank(), []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - start)
    out = torch.tensor([median(times) / 2 if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


# ---------------------------------------------------------------- worker
def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    fixed = opts.fixed_cost > 0
    schedules = opts.schedules
    pp_group = dist.new_group(list(range(world)))
    ends_group = dist.new_group([0, world - 1])
    width = opts.d_model if fixed else None
    pairs = []
    if fixed:
        micro = fixed_micro(opts)
        for name in schedules:
            pairs.append(
                (
                    PlaitFixedSide(name, opts, world, rank, micro),
                    TorchFixedSide(name, opts, world, rank, micro, pp_group),
                )
            )
    else:
        cfg0 = make_config(schedules[0], opts, world)
        corpus = corpus_from_tokens(load_tokens(None, cfg0.data.max_bytes), cfg0)
        for name in schedules:
            pairs.append(
                (
                    PlaitTrainerSide(name, opts, corpus, world),
                    TorchRealSide(name, opts, corpus, world, rank, (pp_group, ends_group)),
                )
            )

    if width is None:
        width = pairs[0][0].cfg.model.d_model
    latency = p2p_latency((opts.micro_batch, opts.seq_len, width))
    for pair in pairs:
        for side in pair:
            run_block(side, opts.warmup, record=False)
    for r in range(opts.rounds):
        for plait_side, torch_side in pairs:
            order = (plait_side, torch_side) if r % 2 == 0 else (torch_side, plait_side)
            for side in order:
                run_block(side, opts.steps, record=True)

    results = {}
    for plait_side, torch_side in pairs:
        name = plait_side.schedule
        entry = {}
        for side in (plait_side, torch_side):
            stats = gather(
                {"sums": dict(side.kind_sums), "counts": dict(side.kind_counts),
                 "steps": len(side.times)}
            )  # fmt: skip
            if side is plait_side:
                plait_stats = stats
            entry[side.name] = side_result(side, stats)
            entry[side.name]["last_step_timings"] = [
                [t.rank, t.index, str(t.action), t.action.kind.value, t.start, t.end]
                for rows in gather(side.last_timings)
                for t in rows
            ]
            entry[side.name]["compute_order"] = gather(side.compute_order)
        n = min(len(plait_side.losses), len(torch_side.losses))
        diffs = [
            abs(a - b) for a, b in zip(plait_side.losses[:n], torch_side.losses[:n], strict=True)
        ]
        entry["loss_first_step"] = {"plait": plait_side.losses[0], "torch": torch_side.losses[0]}
        entry["loss_diff_first_step"] = diffs[0]
        entry["loss_diff_max"] = max(diffs)
        entry["same_compute_order"] = (
            entry["plait"]["compute_order"] == entry["torch"]["compute_order"]
        )
        entry["ratio_of_medians"] = median(plait_side.times) / median(torch_side.times)
        entry["paired_block_ratio"] = paired_ratio(
            plait_side.block_medians, torch_side.block_medians
        )
        entry["pipeline_ratio_of_medians"] = median(plait_side.pipe_times) / median(
            torch_side.pipe_times
        )
        v = chunks_for(name, opts)
        sched = build_schedule(name, world, opts.microbatches, v)
        entry["v"] = v
        plait_all = _records(entry["plait"]["last_step_timings"])
        measured_costs = stage_costs(plait_stats, world, v, sched.split_backward)
        entry["simulated_bubble_measured_costs"] = float(
            simulate(sched, measured_costs).bubble_fraction
        )
        entry["plait_stage_costs_ms"] = {
            k: [x * 1e3 for x in getattr(measured_costs, k)] for k in ("f", "b", "w")
        }
        entry["simulated_bubble_measured_costs_latency"] = float(
            simulate(
                sched, Costs(measured_costs.f, measured_costs.b, measured_costs.w, latency)
            ).bubble_fraction
        )
        if fixed:
            c = opts.fixed_cost / 1e3 / v
            sim = simulate(sched, Costs(f=c, b=c, w=c))
            entry["simulated_bubble"] = float(sim.bubble_fraction)
            entry["ideal_makespan_ms"] = float(sim.makespan) * 1e3
        # plait's own measure() over all its records of the last step (communication too)
        entry["plait_measure_last_step"] = float(measure(plait_all, world)[2])
        results[name] = entry
    return {
        "machine": machine(),
        "mode": "fixed-cost" if fixed else "real",
        "config": {**vars(opts), "world": world, "threads_per_rank": threads_for(world)},
        "p2p_one_way_ms": latency * 1e3,
        "schedules": results,
    }


def _records(rows) -> list[TimedAction]:
    """TimedAction records back from the JSON rows (micro-batch and chunk for compute)."""
    out = []
    for rank, index, text, kind, start, end in rows:
        if kind in ("F", "B", "W"):
            mb, chunk = text[len(kind) :].split(".")[:2]
            action = Action(Kind(kind), int(mb), int(chunk))
        else:
            action = Action(Kind(kind))
        out.append(TimedAction(rank, index, action, start, end))
    return out


# ---------------------------------------------------------------- report and charts
def report(res: dict) -> str:
    c, fixed = res["config"], res["mode"] == "fixed-cost"
    if fixed:
        head = (
            f"### Fixed-cost stages: forward {c['fixed_cost']} ms per stage (÷ v per chunk), "
            f"backward 2× (B = W), {c['cost_mode']}; p={c['world']}, m={c['microbatches']}, "
            f"{c['layers_per_stage']} block(s) per stage, activations "
            f"{c['micro_batch']}×{c['seq_len']}×{c['d_model']} fp32"
        )
    else:
        head = (
            f"### {c['model']} ({c['n_layers']} layers), p={c['world']}, m={c['microbatches']} "
            f"micro-batches of {c['micro_batch']}×{c['seq_len']} tokens, AdamW, clip {c['clip']}"
        )
    rows, bubble_rows, cost_rows = [], [], []
    for name, e in res["schedules"].items():
        p, t = e["plait"], e["torch"]
        rows.append(
            [
                name + (f" (v={e['v']})" if e["v"] > 1 else ""),
                p["median_ms"],
                t["median_ms"],
                f"**{e['ratio_of_medians']:.3f}**",
                e["paired_block_ratio"],
                f"{p['min_ms']:.1f} / {t['min_ms']:.1f}",
                f"{p['pipeline_median_ms']:.1f} / {t['pipeline_median_ms']:.1f}",
                f"{e['loss_diff_first_step']:.1e}",
                "yes" if e["same_compute_order"] else "NO",
            ]
        )
        sim = e.get("simulated_bubble")
        bubble_rows.append(
            [
                name,
                f"{sim:.1%}" if sim is not None else "-",
                f"{e['simulated_bubble_measured_costs']:.1%}",
                f"{e['simulated_bubble_measured_costs_latency']:.1%}",
                f"{p['bubble_median']:.1%}",
                f"{(p['bubble_median'] - sim) * 100:+.1f}" if sim is not None else "-",
                f"{t['bubble_median']:.1%}",
                f"{e['ideal_makespan_ms']:.1f}" if fixed else "-",
            ]
        )
        for side, s in (("plait", p), ("torch", t)):
            for r, means in s["mean_action_ms"].items():
                cost_rows.append(
                    [
                        name,
                        side,
                        r,
                        *(f"{means[k]:.2f}" if k in means else "-" for k in ("F", "B", "W")),
                        f"{means['comm_ms_per_step']:.2f}" if side == "plait" else "-",
                    ]
                )
    lines = [
        head,
        "",
        f"Machine: {describe_machine_md(res['machine'])}; {c['threads_per_rank']} thread(s)/rank;"
        f" p2p one-way {res['p2p_one_way_ms']:.2f} ms per activation message",
        "",
        markdown_table(
            [
                "schedule",
                "plait median ms",
                "torch median ms",
                "plait/torch",
                "per-round",
                "min ms plait / torch",
                "pipeline part ms plait / torch",
                "|Δloss| step 1",
                "same compute order",
            ],
            rows,
        ),
        "",
        markdown_table(
            [
                "schedule",
                "simulated bubble (nominal costs)",
                "simulated (plait's measured F/B/W)",
                "same + p2p latency",
                "plait measured",
                "plait − nominal (points)",
                "torch measured",
                "ideal makespan ms",
            ],
            bubble_rows,
        ),
        "",
        "Mean duration of one action (ms) and plait's time inside p2p batches per step:",
        "",
        markdown_table(["schedule", "side", "rank", "F", "B", "W", "p2p ms/step"], cost_rows),
    ]
    return "\n".join(lines)


def charts(res: dict, prefix: str) -> list[str]:
    """Measured Gantt chart of plait's last step per schedule, and a bubble bar chart."""
    from matplotlib.figure import Figure

    from plait.parallel.pipeline.chart import gantt_chart

    paths = []
    names = list(res["schedules"])
    for name, e in res["schedules"].items():
        recs = [
            TimedAction(t.rank, t.index, t.action, t.start * 1e3, t.end * 1e3)
            for t in _compute_only(_records(e["plait"]["last_step_timings"]))
        ]
        sim = e.get("simulated_bubble")
        title = f"plait {name}, measured bubble {e['plait']['bubble_median']:.1%}"
        if sim is not None:
            title += f", simulated {sim:.1%}"
        path = f"{prefix}_{name}.png"
        gantt_chart(recs, Path(path), title=title, time_unit="ms")
        paths.append(path)
    fig = Figure(figsize=(6.4, 3.0), dpi=100)
    ax = fig.subplots()
    xs = range(len(names))
    width = 0.27
    series = [("torch measured", [res["schedules"][n]["torch"]["bubble_median"] for n in names])]
    series.insert(
        0, ("plait measured", [res["schedules"][n]["plait"]["bubble_median"] for n in names])
    )
    if res["mode"] == "fixed-cost":
        series.insert(0, ("simulated", [res["schedules"][n]["simulated_bubble"] for n in names]))
    for i, (label, vals) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in xs], [v * 100 for v in vals], width, label=label)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("bubble %")
    ax.legend(fontsize=8)
    ax.set_title(f"pipeline bubble, p={res['config']['world']}, m={res['config']['microbatches']}")
    fig.tight_layout()
    path = f"{prefix}_bubble.png"
    fig.savefig(path)
    paths.append(path)
    return paths


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="pipeline ranks (gloo, CPU)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated")
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank, interleaved")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (m)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--model", default="small-gpt", help="plait preset (real mode)")
    ap.add_argument("--n-layers", type=int, default=4, help="real mode; >= world x v")
    ap.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, real mode; 0 = off")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes (real mode)")
    ap.add_argument(
        "--fixed-cost", type=float, default=0.0, help="MS: fixed-cost stages (forward ms/stage)"
    )
    ap.add_argument("--cost-mode", choices=("sleep", "spin"), default="sleep")
    ap.add_argument("--layers-per-stage", type=int, default=1, help="fixed-cost blocks per stage")
    ap.add_argument("--d-model", type=int, default=128, help="fixed-cost activation width")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded steps per side")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--charts", default=None, help="PNG prefix, e.g. benchmarks/results/pp_fixed")
    ap.add_argument("--json", default=None, help="save results here")
    opts = ap.parse_args(argv)
    opts.schedules = [s for s in opts.schedules.split(",") if s]
    unknown = set(opts.schedules) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; known: {', '.join(SCHEDULES)}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    start = time.perf_counter()
    res = spawn(worker, opts.world, opts)
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    res["command"] = env + "python " + " ".join(sys.argv)
    res["plait_module"] = plait.__file__  # which plait was measured (see PYTHONPATH)
    res["wall_s"] = time.perf_counter() - start
    if opts.charts:
        res["charts"] = charts(res, opts.charts)
    print(report(res))
    print(f"\nwall {res['wall_s']:.0f} s")
    save_json(opts.json, res)


if __name__ == "__main__":
    main()
