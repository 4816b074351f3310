"""The optimizer-engine surface: what owns a rank's gradients and optimizer state.

One training step (`plait.step`) is the same for every layout; what differs between plain
data parallelism, ZeRO stages 1-3 with mixed precision and offload, and PipeDream-2BW is the
object behind this surface:

- `zero.engine.ZeroEngine` (stage 0 is plain data parallelism: one bucketed reduction path);
- `pipeline.weight_versions.WeightVersions` (2BW: two weight versions, the update
  one step late; its stream hands it each step's gradients at a consistent cut);
- `naive_dp.Coordinator` (naive data parallelism: rank 0 alone holds the optimizer).

The runners call `micro_batch` and `scale_loss` while they run the micro-batches; the step
calls the rest in the order listed. What the run and the lessons read (`current_model`,
`loss_scale`, `last_step_skipped`, `memory`) is here too, so no caller asks which engine it
holds.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import Tensor, nn

from plait.memory_tracker import MemoryTracker
from plait.mixed_precision import DynamicLossScaler
from plait.parallel.grads import SplitGradRules


class OptimizerEngine(Protocol):
    """A rank's gradients and optimizer state, behind the calls of one step."""

    last_step_skipped: bool  # fp16: the last step overflowed and changed nothing
    memory: MemoryTracker | None  # what this rank holds, by category (None: not tracked)

    @property
    def loss_scale(self) -> float:
        """fp16's current loss scale (1.0 without a scaler): the metrics show it each step."""

    @property
    def current_model(self) -> nn.Module:
        """This rank's part of the model holding the newest weights, to evaluate or sample
        with (2BW: the copy with the latest version; the others: the one model)."""

    def unsharded(self) -> AbstractContextManager:
        """A context in which every parameter of `current_model` holds its full value
        (ZeRO stage 3 gathers them; the others hold them already)."""

    def begin_step(self) -> None:
        """A step starts (memory peaks, bookkeeping)."""

    def micro_batch(self, is_last: bool) -> None:
        """Before each micro-batch's backward: whether it completes the step's gradients."""

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward on (times the loss scale under fp16)."""

    def finish(self) -> None:
        """Every data-parallel reduction complete."""

    def grad_pieces(self) -> list[tuple[nn.Parameter, Tensor]]:
        """(parameter, view of the gradient this rank holds of it), for `SplitGradRules.sync`."""

    def grad_norm(self, rules: SplitGradRules) -> Tensor:
        """The global gradient norm, unscaled, the same on every rank."""

    def clip(self, coef: float) -> None:
        """Multiply the gradients by `coef` in the coming step."""

    def step(self, lr: float) -> bool:
        """Update the parameters; False when the step was skipped (fp16 overflow)."""

    def zero_grad(self) -> None:
        """Start the next step from zero gradients."""

    # -- checkpoints (`plait.checkpoint`) --------------------------------------------------
    step_count: int  # optimizer steps taken (Adam's bias correction continues from it)
    scaler: DynamicLossScaler | None  # fp16's loss scaler, saved with the run

    @property
    def saved_states(self) -> tuple[str, ...]:
        """The fp32 tensors a checkpoint holds per parameter (`master` first)."""

    @property
    def replicated(self) -> bool:
        """Every dp rank holds the same state, so dp rank 0 alone writes it."""

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters this rank holds, by its model's names (the split rules' keys)."""

    def state_dict(self) -> dict[str, Any]:
        """{"step", "loss_scaler", "pieces"}: this rank's pieces of every saved state under
        layout-free (single-process) names (`zero.state_dict.ParamShardState`)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load {"params": name -> state -> full tensor, "step", "loss_scaler"}, saved under
        any layout; a state the checkpoint lacks is the engine's to default or refuse."""

    def close(self) -> None:
        """Remove hooks, files and other resources."""
