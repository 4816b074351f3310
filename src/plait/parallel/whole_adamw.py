"""plait's AdamW over whole parameters, its state in the ZeRO engine's format.

The engines that shard nothing, 2BW's weight versions (`pipeline/weight_versions.py`)
and naive data parallelism's coordinator (`naive_dp.py`), keep every parameter whole on a
rank. They step the same element-wise AdamW as the ZeRO engine (`adamw.py`) and hold its state
the same way: each trainable parameter is a flat group of its own with a single shard (ZeRO
stage 0's arithmetic, `zero/layout.py`), its moments in a `zero/master_states.ResidentStates` whose
master *is* the parameter (fp32: no copy). A checkpoint piece is then what it is for the ZeRO
engine (`zero/state_dict.export_states` and `import_states`, unchanged): the whole parameter,
from element 0, under its layout-free name, so any engine resumes any other's checkpoint.

Frozen parameters (requires_grad False) are left out by the engines: no group, no moments, no
master. The masters are handed in on every call rather than fixed at construction, because
2BW updates whichever of its two weight copies is free, while the moments carry over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from plait.memory_tracker import MemoryTracker
from plait.parallel.adamw import AdamW
from plait.parallel.zero.layout import FlatGroup
from plait.parallel.zero.master_states import ResidentStates
from plait.parallel.zero.state_dict import ParamShardState, export_states, import_states


def trainable(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs that train: the only ones that get optimizer state."""
    return [(n, p) for n, p in named if p.requires_grad]


def _flat(param: Tensor) -> Tensor:
    """A flat view of `param`'s storage (detached: an in-place step then bumps the version
    counter autograd checks, so a graph that still saved the parameter fails loudly)."""
    return param.detach().view(-1)


class WholeAdamW:
    """AdamW moments of whole trainable parameters, and the step that updates them."""

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        adamw: AdamW,
        tracker: MemoryTracker,
    ) -> None:
        """`params` (all trainable) are the first masters; the moments start at zero and are
        counted as `optimizer_states` on `tracker`."""
        frozen = [n for n, p in zip(names, params, strict=True) if not p.requires_grad]
        if frozen:
            raise ValueError(f"frozen parameters get no optimizer state: {frozen}")
        self.adamw = adamw
        self.groups = [
            FlatGroup(i, [p], [n], [0], p.numel(), p.numel(), 0, 1)
            for i, (n, p) in enumerate(zip(names, params, strict=True))
        ]
        device = params[0].device if params else torch.device("cpu")
        masters = [_flat(p) for p in params]
        self.states = ResidentStates(masters, adamw.state_names, "none", device, True, tracker)
        self._decay = [g.decay_segments() for g in self.groups]

    @torch.no_grad()
    def step(self, params: Sequence[Tensor], grads: Sequence[Tensor], step: int, lr: float) -> None:
        """One AdamW step of every parameter in place (`params`: the masters this time, in the
        order given at construction; `step` counts from 1)."""
        self.states.rebind([_flat(p) for p in params])
        for chunk, grad, decay in zip(self.states.chunks(), grads, self._decay, strict=True):
            master = chunk.tensors["master"]
            self.adamw.update(master, grad.reshape(-1), chunk.tensors, step, lr, decay)

    def pieces(self, params: Sequence[Tensor]) -> list[ParamShardState]:
        """Checkpoint pieces: `params` as `master` and the moments, each parameter whole."""
        self.states.rebind([_flat(p) for p in params])
        return export_states(self.groups, self.states)

    def load(self, params: Sequence[Tensor], full: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Write the saved `master` of every parameter into `params` and the saved moments
        into the state (`full`: name -> state -> tensor, as `state_dict.assemble` gives)."""
        self.states.rebind([_flat(p) for p in params])
        import_states(self.groups, self.states, dict(full))
