"""The frozen parameters of a LoRA run: held by the engine, never trained.

The contract declares every base parameter of a LoRA run frozen (models/declare.py): it is
in no trainable flat group, so it gets no gradient, no master copy and no optimizer state.
The engine still decides how it is held:

- in `--base-dtype` (auto: the precision's parameter dtype), so a bf16 run's base takes 2
  bytes per element whatever precision the adapters' masters keep;
- stages 0-2: whole on every data-parallel rank (`hold_frozen`);
- stage 3: sharded over dp like the trainable parameters, in flat groups of its own, one per
  block and the root (`layout.frozen_groups`), gathered per unit just in time
  (`FrozenGatherer`, tag "frozen" in the communication counts) and freed after: the base,
  usually almost all of the model, then costs 1/N per rank. Under a pipeline the walker
  drives its gathers as it drives the adapters' (`pipeline_gather.PipelineGatherer`: kept
  through the step, or regathered per micro-batch and block); The trainer builds a stage-3
  model without storage, so the shards are filled from the run's initial values;
- used in the compute dtype: when the base is held in another dtype, each module owning a
  frozen parameter casts it per forward (`mixed_precision.compute_frozen_in`);
- `--base-dtype nf4` (QLoRA): the blocks' Linear weights in NF4 (zero/nf4_base.py; under
  stage 3 their packed bytes sharded per block, zero/nf4_shards.py), the rest of the base in
  the compute dtype as above.

Their bytes count as `parameters` in the memory tracker (`frozen:NAME` whole, `frozen:I`
a stage-3 shard, `gathered-frozen:I` a gathered unit, transient).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.memory_tracker import MemoryTracker, tensor_bytes
from plait.mixed_precision import compute_frozen_in
from plait.models.contract import contract_of
from plait.parallel.zero.flat_params import Gatherer, ParamStore, initial_flat
from plait.parallel.zero.layout import frozen_groups
from plait.parallel.zero.pipeline_gather import PipelineGatherer
from plait.schedule.stages import StagePlan


def frozen_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter for every parameter the contract declares frozen (a tied weight
    once, under its first name), in registration order."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for entry, param in contract_of(model).bind(model):
        if not entry.decl.trainable and id(param) not in seen:
            seen.add(id(param))
            out[entry.name] = param
    return out


def hold_base(
    model: nn.Module,
    stage: int,
    dtype: torch.dtype,
    compute: torch.dtype,
    comm: Comm,
    axis: str,
    tracker: MemoryTracker,
    initial_value: Callable[..., Tensor] | None = None,
    plans: Sequence[StagePlan] | None = None,
    keep: bool = True,
    held: Collection[str] = (),
) -> tuple[dict[str, nn.Parameter], FrozenGatherer | PipelineGatherer | None]:
    """Hold `model`'s frozen parameters in `dtype` and make it use them in `compute`:
    whole (stages 0-2) or sharded over `axis` (stage 3, whose gatherer is returned; under a
    pipeline, `plans`, one that keeps the stage gathered through the step or not). `held`:
    the names held otherwise already (an NF4 base's weights, zero/nf4_base.py)."""
    every = frozen_params(model)
    frozen = {n: p for n, p in every.items() if n not in held}
    skip = frozenset(id(p) for n, p in every.items() if n in held)
    gatherer = None
    if stage == 3 and frozen:
        n, rank = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
        groups = frozen_groups(model, rank, n, skip)
        values = [initial_flat(g, stage, comm.mesh.device, initial_value) for g in groups]
        store = ParamStore(groups, values, stage, dtype, comm, axis, tracker, "frozen")
        if plans:
            gatherer = PipelineGatherer(model, store, plans, keep)
        else:
            gatherer = FrozenGatherer(model, store)
    else:
        hold_frozen(frozen, dtype, comm.mesh.device, tracker, initial_value)
    compute_frozen_in(model, list(frozen.values()), compute)
    return frozen, gatherer


@torch.no_grad()
def hold_frozen(
    frozen: dict[str, nn.Parameter],
    dtype: torch.dtype,
    device: torch.device,
    tracker: MemoryTracker,
    initial_value: Callable[[nn.Parameter], Tensor] | None = None,
) -> None:
    """Stages 0-2: every frozen parameter whole in `dtype` on `device` (filled from
    `initial_value` where it has no storage yet), its bytes tracked."""
    for name, p in frozen.items():
        if p.numel() and tensor_bytes(p) == 0:
            if initial_value is None:
                raise ValueError(f"frozen parameter {name!r} has no storage and no initial value")
            p.data = initial_value(p).to(device, dtype)
        elif p.dtype != dtype or p.device != device:
            p.data = p.data.to(device, dtype)
        tracker.track(f"frozen:{name}", "parameters", p)


class FrozenGatherer(Gatherer):
    """Stage 3's gathers of the frozen groups: as the trainable ones (`Gatherer`), except
    for when a unit is freed in backward. A trainable unit is freed once its gradients are
    reduced; a frozen one has no gradient, so it is freed when the next unit's backward
    starts (the root when the last block's does: its backward needs the head and the final
    norm), and the first block's by `release_all` once the micro-batch's backward is over
    (the engine calls it at the next micro-batch and at `finish`): so each unit is gathered
    twice per micro-batch, as the trainable ones are."""

    def pre_backward(self, block: int | None):
        gather = super().pre_backward(block)
        if block is None:
            return gather
        last = len(self.blocks) - 1
        done = self.root if block == last else self.group_of(block + 1)

        def hook(grad: Tensor) -> None:
            if done is not None:
                self.release(done)
            gather(grad)

        return hook

    def release_all(self) -> None:
        for gi in list(self.handles):
            self.release(gi)
