"""ZeroEngine: data parallelism with ZeRO stage 0-3 sharding, mixed precision and offload,
behind the optimizer-engine surface (`parallel/optimizer_engine.py`) that `plait.step` drives.
`ZeroEngine(model, comm, optimizer, ZeroOptions(stage=...))`: every setting in one record
(zero/options.py).

One step, in the order the trainer calls it:

    engine.begin_step()                          # memory peaks (optional)
    for i, micro in enumerate(micro_batches):
        engine.micro_batch(is_last=i == n - 1)   # before its forward
        loss = model(...)
        engine.scale_loss(loss / n).backward()   # fp16: times the loss scale
    engine.finish()                              # reductions complete
    rules.sync(engine.grad_pieces(), comm)       # split-model sums (parallel/grads.py)
    norm = engine.grad_norm(rules)               # global norm over the shards
    engine.clip(clip_coef(norm, max_norm))       # folded into the step's unscaling
    stepped = engine.step(lr)                    # False: fp16 overflow, step skipped
    engine.zero_grad()

`plait.step` runs exactly that; the 2BW weight versions offer the same surface.

What each stage keeps per rank (Ψ parameters, N ranks; see docs/zero.md):
  stage 0: everything (plain data parallelism, with master weights when not fp32);
  stage 1: full parameters and gradients; 1/N of master weights and moments;
  stage 2: full parameters; 1/N of gradients, master weights and moments;
  stage 3: 1/N of everything; blocks gathered just in time (params.Gatherer).
A LoRA run's frozen base has parameters only (in --base-dtype): whole under stages 0-2,
1/N under stage 3, gathered per block beside the adapters (zero/frozen.py).

Under a pipeline (`plans`: this rank's stages) stages 2-3 reduce-scatter once per step,
after each chunk's last backward, holding the chunk's full gradient until then
(zero/reducer.py), and stage 3 gathers as `--reshard-after-forward` says
(zero/pipeline_gather.py; the walker calls `pipeline_actions` around each action).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.composition import check_reshard, check_zero
from plait.errors import ConfigError
from plait.memory_tracker import MemoryTracker
from plait.mixed_precision import (
    DynamicLossScaler,
    has_inf_or_nan,
)
from plait.models.contract import contract_of
from plait.parallel.adamw import ElementwiseOptimizer, clip_segments
from plait.parallel.grads import SplitGradRules
from plait.parallel.zero.flat_params import Gatherer, ParamStore, initial_flat
from plait.parallel.zero.frozen import FrozenGatherer, hold_base
from plait.parallel.zero.layout import (
    build_groups,
    nvme_sub_group,
)
from plait.parallel.zero.master_states import ResidentStates
from plait.parallel.zero.nf4_base import hold_nf4
from plait.parallel.zero.nf4_shards import shard_nf4
from plait.parallel.zero.nvme import NvmeStates
from plait.parallel.zero.options import ZeroOptions
from plait.parallel.zero.pipeline_gather import PipelineGatherer, PipelineGathers
from plait.parallel.zero.reducer import GradReducer
from plait.parallel.zero.state_dict import export_states, import_states


class ZeroEngine:
    """Sharded data-parallel training state of one model replica on one rank."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        optimizer: ElementwiseOptimizer,
        options: ZeroOptions | None = None,
    ) -> None:
        """The engine of `model` on this rank as `options` say (zero/options.py; None: plain
        data parallelism in fp32): the trainable parameters laid out in flat groups, this
        rank's shards filled (from the model, or from `options.initial_value`), the frozen
        base held, master weights and optimizer states placed, the reducer's hooks set."""
        o = self.options = options or ZeroOptions()
        check_zero(o.stage, o.offload, str(o.offload_dir) if o.offload_dir else None)
        check_reshard(o.reshard_after_forward, o.stage, 2 if o.plans else 1)
        self.precision = o.parsed_precision()
        contract_of(model)  # groups, gathers and names come from the model's contract
        if o.scaler is not None and not self.precision.needs_scaler:
            raise ConfigError(f"a loss scaler is for fp16; precision is {self.precision.name}")
        self.scaler = o.scaler or (DynamicLossScaler() if self.precision.needs_scaler else None)
        self.model, self.comm, self.optimizer = model, comm, optimizer
        self.stage, self.axis, self.device = o.stage, o.axis, comm.mesh.device
        self.memory = o.tracker or MemoryTracker(self.device)
        n, rank = comm.mesh.size(o.axis), comm.mesh.axis_rank(o.axis)
        self.groups = build_groups(model, o.stage, int(o.bucket_mb * 2**20), rank, n, o.isolate)
        self.frozen_gatherer = self._hold_frozen(o)
        values = [initial_flat(g, o.stage, self.device, o.initial_value) for g in self.groups]
        self.params = ParamStore(self.groups, values, o.stage, self.precision.param_dtype, comm,
                                 o.axis, self.memory)  # fmt: skip
        # fp32 without offload: the parameter shard is the master weight (no copy).
        self.separate_master = self.precision.needs_master or o.offload != "none"
        self.states = self._make_states(values, o.offload, o.offload_dir, o.sub_group_mb)
        del values
        self.gatherer, self.pipeline_actions = self._gatherers_of(o)
        release = self.gatherer.release if self.gatherer else None
        self.grads = GradReducer(self.groups, comm, o.axis, o.stage, self.precision.reduce_dtype,
                                 self.device, self.memory, release,
                                 once_per_step=o.plans is not None)  # fmt: skip
        self._decay = [g.decay_segments() for g in self.groups]
        self.step_count = 0  # optimizer steps taken (skipped ones not counted)
        self.last_step_skipped = False
        self._coef = 1.0
        self._found_inf: bool | None = None

    def _gatherers_of(self, o: ZeroOptions) -> tuple[Gatherer | None, PipelineGathers | None]:
        """Stage 3's gatherer of the trainable parameters, and under a pipeline the walker's
        before/after actions over every gatherer (zero/pipeline_gather.py); else None."""
        if o.stage != 3:
            return None, None
        if not o.plans:
            return Gatherer(self.model, self.params), None
        gatherer = PipelineGatherer(self.model, self.params, o.plans, o.keeps_gathered)
        return gatherer, PipelineGathers([gatherer, self.frozen_gatherer, self.nf4_gatherer])

    def _hold_frozen(self, o: ZeroOptions) -> FrozenGatherer | PipelineGatherer | None:
        """A LoRA run's frozen base (zero/frozen.py): the blocks' Linear weights in NF4 where
        the base is held so (zero/nf4_base.py; under stage 3 their bytes sharded,
        zero/nf4_shards.py), the rest in `o.base_dtype` (default the compute dtype). Sets
        `frozen`, `nf4_weights` and `nf4_gatherer`; returns the frozen base's gatherer
        (stage 3), else None."""
        model, comm, axis, stage = self.model, self.comm, self.axis, self.stage
        compute, keep = self.precision.param_dtype, o.keeps_gathered
        products = self.precision.base_products  # --base-upcast: not the compute dtype
        self.nf4_weights = (
            hold_nf4(model, o.nf4, self.device, self.memory, products) if o.nf4 else {}
        )
        self.nf4_gatherer = None
        if stage == 3 and self.nf4_weights:
            self.nf4_gatherer = shard_nf4(
                model, self.nf4_weights, comm, axis, self.memory, o.plans, keep
            )
        self.frozen, gatherer = hold_base(
            model, stage, o.base_dtype or compute, compute, comm, axis, self.memory,
            o.initial_value, o.plans, keep, self.nf4_weights,
        )  # fmt: skip
        return gatherer

    def _make_states(
        self, values: list[Tensor], offload: str, directory, sub_group_mb: float
    ) -> ResidentStates | NvmeStates:
        """Master weights (from the fp32 initial values) and optimizer states, placed."""
        alias = not self.separate_master
        masters = [
            self.params.shards[g.index] if alias else (v if self.stage == 3 else v[g.lo : g.hi])
            for g, v in zip(self.groups, values, strict=True)
        ]
        names = tuple(self.optimizer.state_names)
        if offload == "nvme":  # a sub-group: master + states, 4 bytes each per element
            sub_group = nvme_sub_group(sub_group_mb, len(names))
            rank = self.comm.mesh.rank
            return NvmeStates(masters, names, directory, rank, sub_group, self.memory)
        return ResidentStates(masters, names, offload, self.device, alias, self.memory)

    # -- the step protocol ---------------------------------------------------------------
    def begin_step(self) -> None:
        self.memory.begin_step()
        if self.pipeline_actions:  # what an evaluation left gathered is stale after a step
            self.pipeline_actions.end_step()

    def micro_batch(self, is_last: bool) -> None:
        """Call before each micro-batch (before its forward in stage 3)."""
        for frozen in (self.frozen_gatherer, self.nf4_gatherer):  # the last one's backward
            if isinstance(frozen, FrozenGatherer):  # is over: 2 gathers per unit each
                frozen.release_all()
        self.grads.micro_batch(is_last)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward on: times the loss scale under fp16, else unchanged."""
        return loss * self.scaler.scale if self.scaler else loss

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def finish(self) -> None:
        """Complete every gradient reduction: the shards hold the averaged (scaled) gradient."""
        self.grads.finish()
        if self.pipeline_actions:  # the update writes the shards: nothing stays gathered
            self.pipeline_actions.end_step()
        for frozen in (self.frozen_gatherer, self.nf4_gatherer):  # no unit of the base is
            if isinstance(frozen, FrozenGatherer):  # needed
                frozen.release_all()
        self._found_inf = None
        self._coef = 1.0
        if self.stage == 0 and self.precision.reduce_dtype == self.precision.param_dtype:
            for g, full in zip(self.groups, self.grads.full, strict=True):  # as DataParallel
                for p, off in zip(g.params, g.offsets, strict=True):
                    p.grad = full[off : off + p.numel()].view_as(p)

    def grad_shards(self) -> list[Tensor]:
        """This rank's gradient shard of every group (still multiplied by the loss scale)."""
        return self.grads.shards

    def found_inf(self) -> bool:
        """Whether any rank's gradient has an inf or nan (fp16 only), agreed by all ranks."""
        if self.scaler is None:
            return False
        if self._found_inf is None:
            flag = has_inf_or_nan(self.grads.shards, self.device)
            self.comm.all_reduce(flag, "world", op="max", tag="found_inf")
            self._found_inf = bool(flag)
        return self._found_inf

    def grad_pieces(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(parameter, view of the part of its gradient in this rank's shards) for every
        parameter piece: what the split-model rules of `parallel/grads.py` work on. Values
        are still multiplied by the loss scale."""
        out = []
        for g, shard in zip(self.groups, self.grads.shards, strict=True):
            for piece in g.pieces():
                view = shard[piece.shard_offset : piece.shard_offset + piece.length]
                out.append((g.params[piece.param], view))
        return out

    def grad_norm(self, rules: SplitGradRules) -> Tensor:
        """The global gradient norm (float64), unscaled: shards summed over dp from stage 1
        on, then over the axes that split the model further (`rules`)."""
        sharded_over = self.axis if self.stage >= 1 else None
        pieces = self.grad_pieces() if rules.uncounted else []  # else the shards are normed whole
        return rules.norm(pieces, self.comm, sharded_over, self.grads.shards, self.loss_scale)

    def clip(self, coef: Tensor | float) -> None:
        """Multiply the gradients by `coef` in the coming step (folded into the unscaling)."""
        self._coef = float(coef)

    @torch.no_grad()
    def step(self, lr: float) -> bool:
        """Update master weights and moments of this rank's shards, then the parameters.

        Returns False (nothing changed) when fp16 gradients overflowed on some rank."""
        factor = self._coef / self.loss_scale  # the scale of these gradients: read first
        found = self.found_inf()
        self.last_step_skipped = self.scaler.update(found) if self.scaler else False
        if self.last_step_skipped:
            return False
        self.step_count += 1
        for chunk in self.states.chunks():
            gi, start, end = chunk.group, chunk.start, chunk.end
            grad = self.grads.shards[gi][start:end].to(chunk.tensors["master"].device)
            grad = grad.to(torch.float32) * factor
            master = chunk.tensors["master"]
            decay = clip_segments(self._decay[gi], start, end)
            self.optimizer.update(master, grad, chunk.tensors, self.step_count, lr, decay)
            if self.separate_master:
                self.params.shards[gi][start:end].copy_(master)
        if self.stage in (1, 2):
            self.params.all_gather()
        return True

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    # -- parameters and state ------------------------------------------------------------
    @property
    def current_model(self) -> nn.Module:
        """The one model this engine steps (stage 3: blocks gathered as they run)."""
        return self.model

    def unsharded(self) -> AbstractContextManager:
        """Context in which every parameter holds its full value (stage 3 gathers)."""
        stack = ExitStack()
        for gatherer in self._gatherers():
            stack.enter_context(gatherer.gathered())
        return stack

    def _gatherers(self) -> list[Gatherer]:
        """Stage 3's gatherers: the trainable parameters' and a LoRA base's."""
        return [g for g in (self.gatherer, self.frozen_gatherer, self.nf4_gatherer) if g]

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def saved_states(self) -> tuple[str, ...]:
        """What a checkpoint holds per parameter: the fp32 master and the optimizer's states
        (the compute-dtype parameters are the masters cast)."""
        return ("master", *self.optimizer.state_names)

    @property
    def replicated(self) -> bool:
        """Stage 0: every dp rank holds the same state, so one of them writes it."""
        return self.stage == 0

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by the names its model gives them."""
        return {n: p for g in self.groups for n, p in zip(g.names, g.params, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, layout-free: the step count, the loss scaler and the
        state of every parameter piece it holds, by single-process name, padding stripped
        (`state_dict.assemble` joins every rank's pieces into full per-parameter states)."""
        return {
            "step": self.step_count,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "pieces": export_states(self.groups, self.states),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load `state["params"]` (name -> master/exp_avg/exp_avg_sq, full tensors, saved
        under any layout) into this rank's shards, and the parameters from the masters."""
        if self.pipeline_actions:  # nothing gathered may keep the values being replaced
            self.pipeline_actions.end_step()
        import_states(self.groups, self.states, state["params"])
        self.step_count = state["step"]
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        for chunk in self.states.chunks():
            self.params.shards[chunk.group][chunk.start : chunk.end].copy_(chunk.tensors["master"])
        if self.stage in (1, 2):
            self.params.all_gather()

    def close(self) -> None:
        """Remove hooks and offload files."""
        self.grads.remove_hooks()
        for gatherer in self._gatherers():
            gatherer.remove_hooks()
        self.states.close()
