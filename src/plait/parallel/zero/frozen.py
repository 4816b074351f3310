"""The frozen parameters of a LoRA run: held by the engine, never trained.

The contract declares every base parameter of a LoRA run frozen (models/declare.py): it is
in no flat group, so it gets no gradient, no master copy and no optimizer state. The engine
still decides how it is held:

- in `--base-dtype` (auto: the precision's parameter dtype), so a bf16 run's base takes 2
  bytes per element whatever precision the adapters' masters keep;
- replicated on every data-parallel rank under every stage. Under stage 3 the trainer
  builds the model without storage (its trainable parameters are filled shard by shard),
  so the frozen ones are filled here, whole, from the run's initial values;
- used in the compute dtype: when the base is held in another dtype, each module owning a
  frozen parameter casts it per forward (`mixed_precision.compute_frozen_in`).

Their bytes count as `parameters` in the memory tracker (one `frozen:NAME` allocation each),
beside the flat groups' compute copies of the adapters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.memory_tracker import MemoryTracker, tensor_bytes
from plait.mixed_precision import compute_frozen_in
from plait.models.contract import contract_of


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


@torch.no_grad()
def hold_frozen(
    model: nn.Module,
    dtype: torch.dtype,
    compute: torch.dtype,
    device: torch.device,
    tracker: MemoryTracker,
    initial_value: Callable[[nn.Parameter], Tensor] | None = None,
) -> dict[str, nn.Parameter]:
    """Give every frozen parameter its storage in `dtype` on `device` (filled from
    `initial_value` where it has none yet: stage 3's streamed start), track its bytes, and
    make the model use it in `compute`. Returns the frozen parameters by name."""
    frozen = frozen_params(model)
    for name, p in frozen.items():
        if p.numel() and tensor_bytes(p) == 0:
            if initial_value is None:
                raise ValueError(f"frozen parameter {name!r} has no storage and no initial value")
            p.data = initial_value(p).to(device, dtype)
        elif p.dtype != dtype or p.device != device:
            p.data = p.data.to(device, dtype)
        tracker.track(f"frozen:{name}", "parameters", p)
    compute_frozen_in(model, list(frozen.values()), compute)
    return frozen
