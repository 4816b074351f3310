"""PipeDream-2BW for real: micro-batches of consecutive steps stream through the pipe, no flush.

The whole run is one `two_bw(p, m, steps=S)` schedule, walked in `comm_batches` exactly like
the synchronous `PipelineRuntime` (the validator proves it deadlock-free that way). Step k's
micro-batches run F and B on weight version max(k-1, 0) (`async_2bw_versions`: version j lives
in copy j % 2 of the rank's stages). Step k's STEP action seals its gradients; the update

    W(k+1) = W(k) - lr_k · AdamW(clip(∇f(W(k-1); batch k)))

runs at a consistent cut before the first forward of step k+2 (`async_2bw_points`, which says
why not at STEP: the update needs collectives). That is the one-step-delayed rule of
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021):
a rank holds at most two weight versions, and the pipe fills and drains once per run.

Data parallelism composes (each replica runs the same schedule; gradients are averaged over
dp at the update point), and so does tensor parallelism, with or without sequence parallelism:
the tp ranks of a stage run the same action list, so their collectives inside F and B line up
as in the synchronous runtime, and the update sums sequence-parallel partial gradients over tp
and counts tp shards once in the norm. Virtual stages do not compose (ConfigError).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plait.comm import Comm
from plait.config import Config
from plait.data import GlobalBatchSampler, eval_indices, replica_share, split_micro
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.models.dropout import sample_keys
from plait.models.transformer import Transformer
from plait.optim import lr_at
from plait.parallel.pipeline.actions import Action, Kind, TimedAction, comm_batches
from plait.parallel.pipeline.async_2bw_points import update_points
from plait.parallel.pipeline.async_2bw_versions import WeightVersions, weights_of
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.p2p import Exchange
from plait.parallel.pipeline.runtime import MicroBatch
from plait.parallel.pipeline.schedules import two_bw
from plait.parallel.pipeline.stage import run_stage
from plait.parallel.tensor_parallel import apply_tensor_parallel
from plait.train import Corpus, StepResult, build_model, load_corpus


def check_two_bw(cfg: Config) -> None:
    """ConfigError, naming the values, for what the 2BW runtime does not combine with."""
    par = cfg.parallel
    if par.virtual_stages != 1:
        raise ConfigError(
            f"schedule 2bw does not interleave: got virtual_stages={par.virtual_stages}"
        )
    two_bw(par.pp, cfg.accumulation, 1)  # m >= p, sizes


@dataclass
class _Flight:
    """Tensors in flight, keyed by (step, micro-batch): micro-batches of two steps overlap."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    grads_in: dict = field(default_factory=dict)
    grads_out: dict = field(default_factory=dict)
    version: dict = field(default_factory=dict)  # forward done, backward not: version used
    data: dict = field(default_factory=dict)  # step -> its micro-batches
    loss: dict = field(default_factory=dict)  # step -> summed micro-batch loss (last stage)
    sealed: dict = field(default_factory=dict)  # step -> (gradients, loss sum) awaiting update


class TwoBWTrainer:
    """One rank's share of an asynchronous 2BW pipeline run (dp x pp x tp ranks)."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        comm: Comm | None = None,
        corpus: Corpus | None = None,
        trace_steps: int = 4,
    ) -> None:
        """`trace_steps`: keep the action timings of about the last this many steps (a run is
        one schedule; keeping all would grow with the run)."""
        check_two_bw(cfg)
        self.cfg, self.mesh = cfg, mesh
        self.comm = comm or Comm(mesh)
        self.corpus = corpus or load_corpus(cfg)
        self.engine = PipelineEngine(cfg, mesh, self.comm)  # plans, shapes, evaluation
        self.p, self.rank, self.m = self.engine.p, self.engine.rank, self.engine.m
        (self.plan,) = self.engine.plans
        model = build_model(cfg.model, mesh.device, cfg.train.seed, self._parallelize)
        self.versions = WeightVersions(model, cfg, self.comm, self.engine.is_last)
        self.sampler = GlobalBatchSampler(
            len(self.corpus.train), cfg.train.global_batch, cfg.train.seed
        )
        self.trace_steps = trace_steps
        shape = self.engine.activation_shape
        self.exchange = Exchange(self.comm, shape, torch.float32, mesh.device)
        self.timings: deque[TimedAction] = deque()
        self.max_versions_held = 0  # distinct versions needed at once, measured per action
        self._ran = False
        self._clock = 0.0  # perf_counter at the previous update

    def _parallelize(self, model: Transformer) -> None:
        """On the meta model, in DESIGN's order: tensor parallel, then the stage split."""
        apply_tensor_parallel(model, self.mesh, self.comm, self.cfg.parallel.sequence_parallel)
        self.engine.prune(model)

    @property
    def model(self) -> Transformer:
        """This rank's stages at the newest weight version (after run: W(steps))."""
        return self.versions.latest_model

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    # -- the run -------------------------------------------------------------------------
    def run(
        self, steps: int | None = None, on_step: Callable[[StepResult], None] | None = None
    ) -> list[StepResult]:
        """Train `steps` (default cfg.train.steps) optimizer steps as one stream.

        `on_step(result)` is called on every rank right after each update, at a point where
        no message is in flight, so it may run collectives (e.g. `evaluate`). A result's
        `time_s` is the wall time since the previous update (the first includes the fill).
        """
        if self._ran:
            raise RuntimeError("TwoBWTrainer.run streams one schedule; build a new trainer")
        self._ran = True
        steps = self.cfg.train.steps if steps is None else steps
        schedule = two_bw(self.p, self.m, 1, steps)
        actions = schedule.ranks[self.rank]
        points = update_points(schedule)[self.rank]
        self.timings = deque(maxlen=self.trace_steps * (len(actions) // steps + 1))
        fl, results = _Flight(), []
        self._clock = time.perf_counter()
        self.comm.stats.begin_step(0)
        for batch in comm_batches(actions):
            for k in points.get(batch.start, []):
                results.append(self._update(k, fl, on_step))
            acts = [actions[i] for i in batch]
            if not acts[0].is_comm:  # the received input it reads, if any (not timed)
                self.exchange.wait_for(acts[0], (acts[0].step, acts[0].microbatch))
            start = time.time()
            if acts[0].is_comm:
                self.exchange.post(acts, [(a.step, a.microbatch) for a in acts], fl)
            else:
                self._compute(acts[0], fl)
            end = time.time()
            self.timings.extend(
                TimedAction(self.rank, i, a, start, end) for i, a in zip(batch, acts, strict=True)
            )
            held = set(fl.version.values()) | {self.versions.latest}
            self.max_versions_held = max(self.max_versions_held, len(held))
        for k in sorted(fl.sealed):  # the last two steps: nothing waits for their versions
            results.append(self._update(k, fl, on_step))
        return results

    def _update(
        self, k: int, fl: _Flight, on_step: Callable[[StepResult], None] | None
    ) -> StepResult:
        self.exchange.drain()  # a consistent cut: every posted send has its receive
        grads, loss_sum = fl.sealed.pop(k)
        lr = lr_at(k, self.cfg.train)
        busy = set(fl.version.values())
        loss, norm = self.versions.update(k, grads, loss_sum, lr, busy)
        now = time.perf_counter()
        result = StepResult(k, loss, lr, norm, now - self._clock, self.tokens_per_step)
        self._clock = now
        if on_step is not None:
            on_step(result)
        self.comm.stats.begin_step(k + 1)
        return result

    # -- compute -------------------------------------------------------------------------
    def _compute(self, a: Action, fl: _Flight) -> None:
        if a.kind is Kind.F:
            self._forward(a, fl)
        elif a.kind is Kind.B:
            self._backward(a, fl)
        else:  # STEP: the step's gradients are complete on this rank
            loss = fl.loss.pop(a.step, torch.zeros((), device=self.mesh.device))
            fl.sealed[a.step] = (self.versions.seal(a.step), loss)
            fl.data.pop(a.step, None)

    def _forward(self, a: Action, fl: _Flight) -> None:
        key, version = (a.step, a.microbatch), weights_of(a.step)
        assert a.version == version, f"schedule says version {a.version}, rule {version}"
        mb = self._micro(a.step, fl)[a.microbatch]
        inp = mb.tokens if self.plan.first else fl.inputs[key].requires_grad_()
        fl.inputs[key] = inp
        targets = mb.targets if self.plan.last else None
        out = run_stage(self.versions.model(version), self.plan, inp, mb.keys, targets)
        if self.plan.last:
            fl.loss[a.step] = fl.loss.get(a.step, 0.0) + out.detach()
            out = out / self.m  # the step's loss is the mean over its micro-batches
        fl.outputs[key], fl.version[key] = out, version

    def _backward(self, a: Action, fl: _Flight) -> None:
        key = (a.step, a.microbatch)
        out, inp = fl.outputs.pop(key), fl.inputs.pop(key)
        grad = None if self.plan.last else fl.grads_out.pop(key)
        torch.autograd.backward(out, grad)  # onto the parameters of the version it ran with
        if not self.plan.first:
            fl.grads_in[key] = inp.grad
        del fl.version[key]

    def _micro(self, step: int, fl: _Flight) -> list[MicroBatch]:
        """Step `step`'s micro-batches for this replica, drawn when first needed (in order)."""
        if step not in fl.data:
            t, device = self.cfg.train, self.mesh.device
            share, positions = replica_share(
                self.sampler.next_batch(), self.mesh.coord.dp, self.mesh.size("dp")
            )
            keys = sample_keys(t.seed, step, positions)
            idx, keys = split_micro(share, t.micro_batch), split_micro(keys, t.micro_batch)
            micro = []
            for i, key in zip(idx, keys, strict=True):
                x, y = (v.to(device) for v in self.corpus.train.batch(i))
                micro.append(MicroBatch(x, y, key.to(device)))
            fl.data[step] = micro
        return fl.data[step]

    # -- validation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation token loss at the newest weights, as `Trainer.evaluate`."""
        t = self.cfg.train
        idx = eval_indices(len(self.corpus.val), t.eval_batches * t.global_batch)
        mine = torch.tensor_split(idx, self.mesh.size("dp"))[self.mesh.coord.dp]
        batches = []
        for chunk in torch.split(mine, t.micro_batch):
            x, y = (v.to(self.mesh.device) for v in self.corpus.val.batch(chunk))
            batches.append(MicroBatch(x, y, torch.zeros(len(chunk), dtype=torch.int64)))
        model = self.model
        self.engine.model = model
        model.eval()
        try:
            totals = self.engine.evaluate(batches)
        finally:
            model.train()
        self.comm.all_reduce(totals, "dp", op="sum", tag="eval")
        return float(totals[0] / totals[1])


def run_two_bw(
    cfg: Config, mesh: Mesh, comm: Comm | None, corpus: Corpus | None, steps: int | None = None
) -> list[float]:
    """Train with the 2BW schedule; the global mean loss of every step (same on all ranks)."""
    return [r.loss for r in TwoBWTrainer(cfg, mesh, comm, corpus).run(steps)]
