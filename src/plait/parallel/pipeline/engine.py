"""Pipeline parallelism inside the trainer: plans, schedule, runtime, and the glue around them.

What a pipeline step needs beyond running the schedule: the loss lives on the last stage and
is shared with every rank for logging; the tied embedding's two copies (first and last stage)
get their gradients summed; the global gradient norm sums every stage once; validation runs
forward-only through the stages; and the measured action timings become a trace, a chart and
a measured bubble next to the simulator's prediction.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from plait.comm import Comm
from plait.config import Config
from plait.mesh import Mesh
from plait.models.transformer import Transformer
from plait.parallel.data_parallel import DataParallel
from plait.parallel.pipeline.actions import Kind, TimedAction
from plait.parallel.pipeline.runtime import MicroBatch, PipelineRuntime
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.simulate import Costs, measure, simulate
from plait.parallel.pipeline.stage import (
    prune_to_stages,
    rank_plans,
    run_stage,
    tied_embedding_params,
)

if TYPE_CHECKING:  # the ZeRO engine imports the pipeline engine for split models
    from plait.parallel.zero import ZeroEngine


class PipelineEngine:
    """This rank's share of a pipeline: its stages and the schedule that drives them."""

    def __init__(self, cfg: Config, mesh: Mesh, comm: Comm) -> None:
        par, t = cfg.parallel, cfg.train
        self.cfg, self.mesh, self.comm = cfg, mesh, comm
        self.p, self.rank = mesh.size("pp"), mesh.axis_rank("pp")
        self.m = cfg.accumulation
        self.schedule = build_schedule(par.schedule, self.p, self.m, par.virtual_stages)
        sizes = par.stage_layer_counts()
        self.plans = rank_plans(cfg.model.n_layers, self.p, par.virtual_stages, self.rank, sizes)
        seq = t.seq_len // (par.tp if par.sequence_parallel else 1)  # sequence-parallel shards
        self.activation_shape = (t.micro_batch, seq, cfg.model.d_model)
        self.runtime: PipelineRuntime | None = None
        self.activation_dtype = torch.float32
        self.model: Transformer | None = None

    @property
    def is_last(self) -> bool:
        return any(plan.last for plan in self.plans)

    def prune(self, model: Transformer) -> None:
        """The `parallelize` step: keep only this rank's stages (called on the meta model)."""
        prune_to_stages(model, self.plans)

    def attach(
        self,
        model: Transformer,
        grads: DataParallel | ZeroEngine,
        activation_dtype: torch.dtype = torch.float32,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Run this rank's stages of `model`; `grads` (DataParallel or the ZeRO engine)
        reduces their gradients over dp; activations travel in `activation_dtype` (the
        compute dtype); `scale_loss` multiplies the last stage's loss (fp16 loss scale)."""
        self.model = model
        self.activation_dtype = activation_dtype
        self.runtime = PipelineRuntime(
            self.schedule,
            self.rank,
            model,
            self.plans,
            self.comm,
            grads,
            self.activation_shape,
            activation_dtype,
            scale_loss,
        )

    # -- training ------------------------------------------------------------------------
    def run(self, micro: list[MicroBatch]) -> torch.Tensor:
        """One step's forward and backward; returns the step's mean loss on every pp rank."""
        loss = self.runtime.run(micro) / self.m
        self.comm.all_reduce(loss, "pp", op="sum", tag="loss")  # only the last stage is nonzero
        return loss

    def sync_tied_grads(self) -> None:
        """Sum the gradients of the embedding copies held by the first and last stage."""
        for p in tied_embedding_params(self.model):
            self.comm.all_reduce(p.grad, "pp_ends", op="sum", tag="tied_embedding")

    def norm_duplicates(self) -> list[torch.nn.Parameter]:
        """Parameters another stage already counts in the global gradient norm: the last
        stage's copy of a tied embedding (the first stage counts the shared matrix)."""
        copies = tied_embedding_params(self.model)
        if self.mesh.size("pp_ends") > 1 and self.is_last and copies:
            return copies[-1:]
        return []

    def sum_over_stages(self, sq: torch.Tensor) -> torch.Tensor:
        """Every stage's share of the squared gradient norm, summed (in place)."""
        self.comm.all_reduce(sq, "pp", op="sum", tag="grad_norm")
        return sq

    # -- validation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Forward-only through the stages in order; returns (loss x tokens, tokens) summed."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.mesh.device)
        for mb in batches:
            for stage in range(self.schedule.num_stages):
                owner, chunk = self.schedule.location(stage)
                if owner == self.rank:
                    self._eval_stage(self.plans[chunk], mb, totals)
        self.comm.all_reduce(totals, "pp", op="sum", tag="eval")
        return totals

    def _eval_stage(self, plan, mb: MicroBatch, totals: torch.Tensor) -> None:
        """Stage s receives from the owner of s-1 and sends to the owner of s+1 (rank = s % p)."""
        prev, nxt = (self.rank - 1) % self.p, (self.rank + 1) % self.p
        if plan.first:
            x = mb.tokens
        else:
            shape = (mb.tokens.shape[0], *self.activation_shape[1:])
            x = torch.empty(shape, dtype=self.activation_dtype, device=self.mesh.device)
            self.comm.p2p([("recv", x, prev)], tag="eval").wait()
        out = run_stage(self.model, plan, x, None, mb.targets if plan.last else None)
        if plan.last:
            totals[0] += out.double() * mb.targets.numel()
            totals[1] += mb.targets.numel()
        else:
            self.comm.p2p([("send", out.contiguous(), nxt)], tag="eval").wait()

    # -- observability -------------------------------------------------------------------
    def gather_timings(self) -> list[TimedAction]:
        """All pp ranks' timings of the last step, gathered to every rank of the pp group."""
        counts = [len(acts) for acts in self.schedule.ranks]
        width = max(counts)
        mine = torch.zeros(width, 2, dtype=torch.float64)
        for t in self.runtime.timings:
            mine[t.index] = torch.tensor([t.start, t.end], dtype=torch.float64)
        everyone = torch.empty(self.p * width, 2, dtype=torch.float64)
        self.comm.all_gather(everyone, mine.to(self.mesh.device), "pp", tag="trace")
        rows = everyone.cpu().view(self.p, width, 2)
        return [
            TimedAction(r, i, self.schedule.ranks[r][i], float(rows[r, i, 0]), float(rows[r, i, 1]))
            for r in range(self.p)
            for i in range(counts[r])
        ]

    def report(self, timings: list[TimedAction], out: Path) -> dict:
        """Measured bubble next to the simulator's prediction from the measured mean costs;
        writes the Chrome trace and the Gantt chart (rank 0 only)."""
        from plait.parallel.pipeline.chart import gantt_chart, write_trace

        origin = min(t.start for t in timings)
        shifted = [TimedAction(t.rank, t.index, t.action, t.start - origin, t.end - origin)
                   for t in timings]  # fmt: skip
        makespan, _, bubble = measure(shifted, self.p)
        costs = self._measured_costs(shifted)
        predicted = simulate(self.schedule, costs).bubble_fraction
        out.mkdir(parents=True, exist_ok=True)
        name = f"pipeline-{self.schedule.name}-p{self.p}-m{self.m}-v{self.schedule.v}"
        write_trace(shifted, out / f"{name}.trace.json")
        title = f"{name}: measured bubble {float(bubble):.1%}, simulated {float(predicted):.1%}"
        gantt_chart(shifted, out / f"{name}.png", title=title, time_unit="s")
        result = {
            "schedule": self.schedule.name,
            "makespan_s": float(makespan),
            "measured_bubble": float(bubble),
            "simulated_bubble": float(predicted),
            "mean_cost_s": {"f": costs.f, "b": costs.b, "w": costs.w},
        }
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        return result

    def _measured_costs(self, timings: list[TimedAction]) -> Costs:
        def mean(kind: Kind) -> float:
            values = [t.duration for t in timings if t.action.kind is kind]
            return statistics.fmean(values) if values else 0.0

        f, b, w = mean(Kind.F), mean(Kind.B), mean(Kind.W)
        if not self.schedule.split_backward:  # B ran the whole backward: split it evenly
            b, w = b / 2, b / 2
        return Costs(f=f, b=b, w=w)
