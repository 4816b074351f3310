"""ZeRO-3 under a pipeline: when a stage's parameters are gathered and freed.

Without a pipeline, each micro-batch runs one forward and one backward of the whole model,
and `flat_params.Gatherer` gathers every block around each (FSDP's reshard after forward).
A pipeline rank instead interleaves the forwards and backwards of many micro-batches over
its stages (chunks), and calls the model's parts directly (`pipeline/stage.run_stage`), so
the rank's walker tells the gatherer which action comes (`before`/`after`). Two policies,
named as torchtitan names FSDP's (`--reshard-after-forward`):

- keep (`never`; the default under a pipeline): each unit is gathered at its first use in
  the step and kept through every micro-batch; it is freed once its gradients are complete
  (the reducer's `on_group_done`, at the chunk's last backward), the rest when the step's
  reductions are done (`end_step`). One all-gather per unit per step; the whole stage's
  parameters are held at once.
- regather (`always`): as without a pipeline, per block: gathered before the block's
  forward and freed after it; gathered again when its backward starts, freed when the
  backward moves on to the block before it (within the chunk) or the action ends; under
  zb-h1 the weight pass W gathers the chunk's blocks once more (it runs no block hooks).
  Per micro-batch two all-gathers per block (three under zb-h1 except on the first stage,
  whose B computes nothing): m times the traffic, for one or two blocks gathered at a time.

A LoRA run's frozen base follows the same policy in its own groups (no gradients: kept
units are freed at the step's end). The ends (embedding, final norm, head, a tied
embedding's copy) are gathered at the first
forward that reaches them (a hook on the embedding and the final norm) and kept through the
step under both policies, as FSDP keeps its root module: they are used at both ends of
every micro-batch. Prefetching never crosses a chunk: the next block of the rank may belong
to a chunk whose action is far away in the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor, nn

from plait.models.contract import contract_of
from plait.parallel.zero.flat_params import Gatherer, ParamStore
from plait.schedule.actions import Kind
from plait.schedule.stages import StagePlan


class PipelineGatherer(Gatherer):
    """Stage 3's gathers on a pipeline rank that runs `plans` (one per chunk)."""

    def __init__(
        self, model: nn.Module, store: ParamStore, plans: Sequence[StagePlan], keep: bool
    ) -> None:
        super().__init__(model, store)
        self.keep = keep
        chunk_of = {layer: c for c, plan in enumerate(plans) for layer in plan.layers}
        self.chunk = [chunk_of[part.index] for part in contract_of(model).blocks()]
        self.ends = list(range(len(self.blocks), len(store.groups)))
        for path in ("embed", "norm"):
            module = model.get_submodule(path)
            if any(True for _ in module.parameters()):  # held here, not `Absent`
                self._hooks.append(module.register_forward_pre_hook(self._ends_pre))

    def _runs_after(self, i: int, j: int) -> bool:
        return 0 <= j < len(self.blocks) and self.chunk[i] == self.chunk[j]

    # -- the walker's calls ------------------------------------------------------------
    def before(self, kind: Kind, chunk: int) -> None:
        """Before an F, B or W of `chunk`: whether block hooks run in a backward; W's
        gathers (regather: it runs no block hooks, and its graph holds the weights)."""
        self.backward = kind is not Kind.F
        if kind is Kind.W and not self.keep:
            mine = [self.group_of(i) for i, c in enumerate(self.chunk) if c == chunk]
            for gi in mine:
                self.prefetch(gi)
            for gi in mine:
                self.ensure(gi)

    def after(self, kind: Kind, chunk: int) -> None:
        """After the action: regather frees every block still gathered."""
        if not self.keep:
            for gi in [g for g in self.handles if g not in self.ends]:
                self.release(gi)
        self.backward = False

    def end_step(self) -> None:
        """Everything freed: the step's reductions are done (and the update is next, which
        writes the shards, so nothing gathered may outlive the step)."""
        for gi in list(self.handles):
            self.release(gi)

    # -- hooks -------------------------------------------------------------------------
    def _ends_pre(self, module, args) -> None:
        for gi in self.ends:
            self.prefetch(gi)
        for gi in self.ends:
            self.ensure(gi)

    def _root_pre(self, module, args) -> None:
        pass  # a pipeline runs the parts, never the whole model

    def _root_post(self, module, args, output) -> None:
        pass

    def pre_backward(self, block: int | None):
        """Regather: block `block`'s backward starts, so the one after it in the chunk
        (whose backward produced this gradient) is done: free it, gather this one."""

        def hook(grad: Tensor) -> None:
            self.backward = True
            if self._runs_after(block, block + 1):
                self.release(self.group_of(block + 1))
            self.ensure(self.group_of(block))
            if self._runs_after(block, block - 1):
                self.prefetch(self.group_of(block - 1))

        return hook


class PipelineGathers:
    """The walker's hooks over every stage-3 gatherer of the rank: the trainable
    parameters' and, under LoRA, the frozen base's (`frozen.hold_base`)."""

    def __init__(self, gatherers: Iterable[PipelineGatherer | None]) -> None:
        self.gatherers = [g for g in gatherers if g is not None]

    def before(self, kind: Kind, chunk: int) -> None:
        for g in self.gatherers:
            g.before(kind, chunk)

    def after(self, kind: Kind, chunk: int) -> None:
        for g in self.gatherers:
            g.after(kind, chunk)

    def end_step(self) -> None:
        for g in self.gatherers:
            g.end_step()
