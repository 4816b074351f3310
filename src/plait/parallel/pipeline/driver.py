"""Pipeline parallelism inside the trainer: this rank's stages, its schedule and its runtime.

What a pipeline step needs beyond walking the schedule (`walker.py`): the loss lives on the last
stage and is shared with every pp rank; validation runs forward-only through the stages; the
action timings of every pp rank are gathered for the trace (`schedule/measured.py` draws and
measures them). The schedule is built by name from the registry of `plait.schedule.schedules`
for every schedule alike; PipeDream-2BW's stream (`two_bw.py`) walks its own run-long schedule
of that family over this rank's stages. The gradient rules the split adds (the tied
embedding's two copies, the norm summed over the stages) live in `parallel/grads.py` with the
other split-model rules.
"""

from __future__ import annotations

import torch

from plait.comm import Comm
from plait.config import ParallelConfig
from plait.mesh import Mesh
from plait.microbatch import MicroBatch
from plait.models.architecture import ModelConfig
from plait.models.loss import target_count
from plait.models.transformer import Transformer
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.parallel.pipeline.stage import prune_to_stages, run_stage
from plait.parallel.pipeline.walker import ActionHooks, PipelineRuntime
from plait.schedule.actions import TimedAction
from plait.schedule.schedules import build_schedule
from plait.schedule.stages import rank_plans


class PipelineDriver:
    """This rank's share of a pipeline: its stages and the schedule that drives them."""

    def __init__(
        self,
        par: ParallelConfig,
        arch: ModelConfig,
        micro_batch: int,
        seq_len: int,
        microbatches: int,
        mesh: Mesh,
        comm: Comm,
    ) -> None:
        """`microbatches` per step (m), each of `micro_batch` sequences of `seq_len`."""
        self.mesh, self.comm = mesh, comm
        self.p, self.rank = mesh.size("pp"), mesh.axis_rank("pp")
        self.m = microbatches
        self.schedule = build_schedule(par.schedule, self.p, self.m, par.virtual_stages)
        sizes = par.stage_layer_counts()
        self.plans = rank_plans(arch.n_layers, self.p, par.virtual_stages, self.rank, sizes)
        # A context-parallel rank's tokens of each row, then its sequence-parallel shard.
        seq = seq_len // par.cp // (par.tp if par.sequence_parallel else 1)
        self.activation_shape = (micro_batch, seq, arch.d_model)
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
        engine: OptimizerEngine,
        activation_dtype: torch.dtype = torch.float32,
        actions: ActionHooks | None = None,
    ) -> None:
        """Run this rank's stages of `model`, one walk of the schedule per step (`run`);
        `engine` reduces their gradients over dp and scales the last stage's loss (fp16);
        activations travel in `activation_dtype`; `actions` are told of every compute action
        (ZeRO-3's gathers). (2BW's stream walks instead: `two_bw.py`.)"""
        self.model = model
        self.activation_dtype = activation_dtype
        self.runtime = PipelineRuntime(
            self.schedule,
            self.rank,
            model,
            self.plans,
            self.comm,
            engine,
            self.activation_shape,
            activation_dtype,
            actions,
        )

    # -- training ------------------------------------------------------------------------
    def run(self, micro: list[MicroBatch]) -> torch.Tensor:
        """One step's forward and backward; returns this replica's share of the step's
        token-weighted loss (summed over its micro-batches) on every pp rank."""
        loss = self.runtime.run(micro)
        self.comm.all_reduce(loss, "pp", op="sum", tag="loss")  # only the last stage is nonzero
        return loss

    # -- validation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model: Transformer, batches: list[MicroBatch]) -> torch.Tensor:
        """Forward-only through `model`'s stages (this rank's; 2BW: its newest weights), in
        stage order; returns (summed target loss, target tokens) over the batches."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.mesh.device)
        for mb in batches:
            for stage in range(self.schedule.num_stages):
                owner, chunk = self.schedule.location(stage)
                if owner == self.rank:
                    self._eval_stage(model, self.plans[chunk], mb, totals)
        self.comm.all_reduce(totals, "pp", op="sum", tag="eval")
        return totals

    def _eval_stage(self, model: Transformer, plan, mb: MicroBatch, totals: torch.Tensor) -> None:
        """Stage s receives from the owner of s-1 and sends to the owner of s+1 (rank = s % p)."""
        prev, nxt = (self.rank - 1) % self.p, (self.rank + 1) % self.p
        if plan.first:
            x = mb.tokens
        else:
            shape = (mb.tokens.shape[0], *self.activation_shape[1:])
            x = torch.empty(shape, dtype=self.activation_dtype, device=self.mesh.device)
            self.comm.p2p([("recv", x, prev)], tag="eval").wait()
        targets = mb.targets if plan.last else None
        out = run_stage(model, plan, x, None, targets, mb.segments, 1.0)  # 1.0: the sum
        if plan.last:
            totals[0] += out.double()
            totals[1] += target_count(mb.targets)
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
