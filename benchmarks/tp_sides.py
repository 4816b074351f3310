"""The two sides of `bench_tp.py`, the DTensor plan of its torch side, and the instrument
that counts their collective bytes.

Sides: plait's tensor-parallel model (`apply_tensor_parallel`) and the plain model
parallelized by DTensor's `parallelize_module` with a torchtitan-style plan, each behind one
step protocol that times the same phases (forward, backward, sync, clip, optim, zero).

Instrument, used only in an untimed step because it runs Python on every op:
`CollectiveBytes`, a `CommDebugMode` that also records each collective's logical bytes by
step phase. DTensor lowers its redistributions to `_c10d_functional` ops and plait calls
`c10d` ops, so the same counter sees both sides.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import common
from common import logical_bytes, tally
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import OptimConfig
from plait.models.architecture import ModelConfig
from plait.optim import build_optimizer
from plait.parallel.grads import SplitGradRules, clip_coef, param_grads

PHASES = ("forward", "backward", "sync", "clip", "optim", "zero")


# ---------------------------------------------------------------- the DTensor side
def dtensor_plan(cfg: ModelConfig, sp: bool) -> dict:
    """parallelize_module plan for a models.transformer.Transformer (torchtitan's recipe)."""
    between = Shard(1) if sp else Replicate()  # the residual stream between blocks
    plan: dict = {}
    if sp and cfg.pos == "learned":
        # Embedding.forward adds the (s, h) position table to the token lookup, so the lookup
        # must be whole: sum it (all-reduce), add positions, then keep this rank's positions.
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
        plan["embed"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1)
        )
    else:  # reduce-scatter straight into sequence shards under SP, all-reduce without
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    plan["head"] = ColwiseParallel(
        input_layouts=between, output_layouts=Shard(-1), use_local_output=False
    )
    if sp:
        plan["norm"] = SequenceParallel()
    mlp = ("w_gate", "w_up", "w_down") if cfg.mlp == "swiglu" else ("fc1", "fc2")
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        plan[b + "attn"] = PrepareModuleInput(
            input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
        )
        plan[b + "mlp"] = PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        )
        for name in ("wq", "wk", "wv"):
            plan[b + "attn." + name] = ColwiseParallel()
        plan[b + "attn.wo"] = RowwiseParallel(output_layouts=between)
        for name in mlp[:-1]:
            plan[b + "mlp." + name] = ColwiseParallel()
        plan[b + "mlp." + mlp[-1]] = RowwiseParallel(output_layouts=between)
        if sp:
            plan[b + "attn_norm"] = SequenceParallel()
            plan[b + "mlp_norm"] = SequenceParallel()
    return plan


def build_dtensor_model(cfg: ModelConfig, seed: int, sp: bool, world: int) -> torch.nn.Module:
    model = build_model(cfg, torch.device("cpu"), seed)  # the unsharded model, same init
    parallelize_module(model, init_device_mesh("cpu", (world,)), dtensor_plan(cfg, sp))
    if cfg.tie_embeddings:  # parallelize_module gave head and embedding separate DTensors
        model.head.weight = model.embed.tok.weight
    return model


# ---------------------------------------------------------------- bytes per collective
class CollectiveBytes(CommDebugMode):
    """CommDebugMode that also records (phase, op) -> calls and logical bytes.

    CommDebugMode lets DTensor lower its ops first (it returns NotImplemented for DTensor
    arguments), so what arrives here with plain tensors are the collectives actually issued.
    `phase` is set by the step code (forward, backward, ...). Logical bytes as in plait's
    `comm.py`: all-reduce the buffer, all-gather the gathered output, reduce-scatter the input.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.records: dict[tuple[str, str], dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            op = func._overloadpacket.__name__
            tally(self.records, (self.phase, op), 1, logical_bytes(op, args))
        return out

    def summary(self) -> dict:
        """Totals, by op (plait's names where they differ) and by phase, and every record."""
        by_op: dict[str, dict[str, int]] = {}
        by_phase: dict[str, int] = defaultdict(int)
        for (phase, op), rec in self.records.items():
            tally(by_op, OP_NAMES.get(op, op), rec["calls"], rec["bytes"])
            by_phase[phase] += rec["bytes"]
        return {
            "bytes": sum(by_phase.values()),
            "calls": sum(d["calls"] for d in by_op.values()),
            "by_op": dict(sorted(by_op.items())),
            "by_phase": dict(by_phase),
            "records": [
                [p, o, r["calls"], r["bytes"]] for (p, o), r in sorted(self.records.items())
            ],
        }


OP_NAMES = {
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
}


# ---------------------------------------------------------------- the two sides
class Side(common.Side):
    """One implementation's model, optimizer and step, with per-phase timings."""

    def __init__(self, name: str, model: torch.nn.Module, opts, train_cfg: OptimConfig) -> None:
        super().__init__(name, PHASES)
        self.model, self.clip = model, opts.clip
        self.opt = build_optimizer(model, train_cfg)

    def run_step(self, x, y, counter: CollectiveBytes | None = None) -> dict[str, float]:
        raise NotImplementedError


def _mark(counter: CollectiveBytes | None, phase: str) -> None:
    if counter is not None:
        counter.phase = phase


class PlaitSide(Side):
    def __init__(self, model, comm: Comm, opts, train_cfg: OptimConfig) -> None:
        super().__init__("plait", model, opts, train_cfg)
        self.comm, self.step = comm, 0
        self.rules = SplitGradRules.of(model, comm.mesh)
        self.stats_last: dict = {}

    def run_step(self, x, y, counter=None) -> dict[str, float]:
        clock = time.perf_counter
        self.comm.stats.begin_step(self.step)
        t0 = clock()
        loss = self.model(x, y)
        t1 = clock()
        _mark(counter, "backward")
        loss.backward()
        t2 = clock()
        _mark(counter, "sync")
        self.rules.sync(param_grads(self.model), self.comm)  # no-op without SP
        t3 = clock()
        _mark(counter, "clip")
        if self.clip > 0:  # clip 0 = off on both sides
            coef = clip_coef(self.rules.norm(param_grads(self.model), self.comm), self.clip)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        t4 = clock()
        _mark(counter, "optim")
        self.opt.step()
        t5 = clock()
        self.opt.zero_grad(set_to_none=True)
        t6 = clock()
        self.losses.append(float(loss.detach()))
        self.stats_last = {
            "bytes_by_op": self.comm.stats.bytes_by_op(),
            "total": self.comm.stats.total(axis="tp"),
            "rows": self.comm.stats.as_rows(),
        }
        self.step += 1
        return dict(
            forward=t1 - t0,
            backward=t2 - t1,
            sync=t3 - t2,
            clip=t4 - t3,
            optim=t5 - t4,
            zero=t6 - t5,
        )


class DTensorSide(Side):
    def __init__(self, model, opts, train_cfg: OptimConfig) -> None:
        super().__init__("dtensor", model, opts, train_cfg)
        params = list(model.parameters())
        self.dparams = [p for p in params if isinstance(p, DTensor)]
        self.plain = [p for p in params if not isinstance(p, DTensor)]
        self.eager_partial = opts.dtensor_partial == "eager"

    def run_step(self, x, y, counter=None) -> dict[str, float]:
        clock = time.perf_counter
        t0 = clock()
        with loss_parallel():  # the backward must run inside it too
            loss = self.model(x, y)
            t1 = clock()
            _mark(counter, "backward")
            loss.backward()
        t2 = clock()
        _mark(counter, "sync")
        if self.eager_partial:  # reduce Partial gradients (SP norms) once, not in every use
            for p in self.dparams:
                if p.grad is not None and any(isinstance(q, Partial) for q in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.placements))
        t3 = clock()
        _mark(counter, "clip")
        if self.clip > 0:
            self._clip()
        t4 = clock()
        _mark(counter, "optim")
        self.opt.step()
        t5 = clock()
        self.opt.zero_grad(set_to_none=True)
        t6 = clock()
        self.losses.append(float(loss.detach().to_local()))
        return dict(
            forward=t1 - t0,
            backward=t2 - t1,
            sync=t3 - t2,
            clip=t4 - t3,
            optim=t5 - t4,
            zero=t6 - t5,
        )

    def _clip(self) -> None:
        """clip_grad_norm_ over DTensor and plain parameters (it rejects the mix)."""
        utils = torch.nn.utils
        norm = utils.get_total_norm([p.grad for p in self.dparams if p.grad is not None])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if self.plain:
            rest = utils.get_total_norm([p.grad for p in self.plain if p.grad is not None])
            norm = (norm.square() + rest.square()).sqrt()
        utils.clip_grads_with_norm_(self.dparams, self.clip, norm)
        if self.plain:
            utils.clip_grads_with_norm_(self.plain, self.clip, norm)


def counted_step(side: Side, batch) -> dict:
    """One untimed step under CollectiveBytes: what each side sends, by op and phase."""
    with warnings.catch_warnings():  # CommDebugMode's module tracker warns about hooks
        warnings.simplefilter("ignore")
        with CollectiveBytes() as counter:
            side.run_step(*batch, counter=counter)
    return counter.summary()


def initial_param_diff(plait_model, dt_model) -> float:
    """Largest |plait shard - DTensor local shard| over all parameters (same names)."""
    theirs = dict(dt_model.named_parameters())
    worst = 0.0
    for name, p in plait_model.named_parameters():
        q = theirs[name]
        q = q.to_local() if isinstance(q, DTensor) else q
        if q.shape != p.shape:
            raise RuntimeError(f"{name}: plait shard {tuple(p.shape)} vs DTensor {tuple(q.shape)}")
        worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    return worst
