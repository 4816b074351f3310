"""The two weight versions of PipeDream-2BW on one rank, and the delayed update between them.

Version j lives in copy j % 2 of this rank's (pruned) model. In-flight micro-batches run on
the copy holding their version, so their autograd graphs save that copy's own parameter
tensors and their gradients accumulate on them; nothing is swapped in or out of a module
while a graph depends on it. Activation recomputation works unchanged, since a recomputed
forward runs the same copy again; activation offload wraps each copy's blocks (after
recompute, as on one model), so a micro-batch's saved tensors wait on the host whichever
version it runs.

The update of step k (W(k+1) = W(k) - lr·AdamW(g_k), g_k computed at W(k-1)) writes into the
copy that held W(k-1), free by then: first W(k) is copied there, then plait's AdamW steps it
in place (`parallel/whole_adamw.py`, the ZeRO engine's AdamW and state format over whole
parameters). Its moments carry over from step to step while its target alternates between the
two copies: the copy to update is handed to it each step. The target copy has no live graph
(checked), so the in-place step can never corrupt a saved tensor of an in-flight micro-batch.
Two copies plus moments: the paper's 2W + optimizer state, no third weight copy. Frozen
parameters (LoRA's base) are shared by both copies: held once, never copied, stepped or
given moments, so 2BW's second version costs only the trainable parameters.

Under tensor parallelism each copy holds this rank's shards; the copy shares the original's
`Comm` (deep-copying it would copy process groups).

`WeightVersions` is an optimizer engine (`parallel/optimizer_engine.py`): the 2BW stream
hands it step k's sealed gradients at the update point (`take`), and the one training step
(`plait.step`) then runs on it exactly as on the ZeRO engine: dp average (`finish`), the
split-model gradient rules on copy 0's parameters (`grad_pieces`), the global norm, clipping
and the update (`step`). 2BW is thereby a weight-version policy, not a second trainer.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.config import OptimConfig
from plait.memory_tracker import MemoryTracker, tensor_bytes
from plait.models.transformer import Transformer
from plait.parallel.activation_offload import apply_activation_offload
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules
from plait.parallel.whole_adamw import WholeAdamW, trainable


def weights_of(step: int) -> int:
    """The weight version step `step`'s micro-batches run with: max(step - 1, 0)."""
    return max(step - 1, 0)


class WeightVersions:
    """Two copies of this rank's stages and the optimizer that steps between them."""

    last_step_skipped = False  # fp32 only: a step is never skipped
    loss_scale = 1.0

    def __init__(
        self,
        model: Transformer,
        optim: OptimConfig,
        comm: Comm,
        recompute: str,
        offload_activations: str = "none",
    ) -> None:
        self.comm = comm
        # Copy before recompute and offload: their wrappers close over the module they wrap.
        # The copy's tp layers keep using the same Comm (memo), not a copy of its process
        # groups, and the same frozen parameters (LoRA's base): they never change, so one is
        # held, not two.
        memo: dict[int, Any] = {id(comm): comm}
        memo.update((id(p), p) for p in model.parameters() if not p.requires_grad)
        self.copies = [model, copy.deepcopy(model, memo=memo)]
        for c in self.copies:
            apply_recompute(c, recompute)
            apply_activation_offload(c, offload_activations)
            c.train()
        # The trainable parameters of each copy, in the same order (deepcopy keeps it).
        self.params = [[p for _, p in trainable(list(c.named_parameters()))] for c in self.copies]
        self.names = [n for n, _ in trainable(list(model.named_parameters()))]
        self.held = [0, None]  # the version each copy holds (copy 1 holds nothing yet)
        self.latest = 0
        self.memory = self._track(model)
        self.optimizer = WholeAdamW(
            self.names, self.params[0], AdamW.from_optim(optim), self.memory
        )
        self._grads: list[Tensor] | None = None  # the step being updated, from `take`
        self._busy: set[int] = set()
        self._coef = 1.0

    def _track(self, model: Transformer) -> MemoryTracker:
        """The memory tracker of this rank, as every engine has one: both weight versions and
        the frozen base (once) as parameters; each gradient from its first accumulation on a
        copy until the update that consumes it (`zero_grad`), transient: a step's sealed
        gradients wait for their update while the next step's accumulate (on the other copy,
        or on the same one for steps 0 and 1, which both run on version 0).
        The optimizer registers the moments (its masters are the copies' own tensors)."""
        tracker = MemoryTracker(self.comm.mesh.device)
        for c, params in enumerate(self.params):
            tracker.track(f"version:{c}", "parameters", sum(tensor_bytes(p) for p in params))
        frozen = {
            p.untyped_storage().data_ptr(): p for p in model.parameters() if not p.requires_grad
        }
        if frozen:
            tracker.track("frozen", "parameters", sum(tensor_bytes(p) for p in frozen.values()))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad(c, i))
            for c, params in enumerate(self.params)
            for i, p in enumerate(params)
        ]
        self._stepped = 0  # the step whose sealed gradients the pending update consumes
        return tracker

    def _on_grad(self, c: int, i: int):
        def hook(p: nn.Parameter) -> None:
            self.memory.track(f"grad:{c}:{i}", "gradients", p.grad, transient=True)

        return hook

    def model(self, version: int) -> Transformer:
        """The copy that holds `version` (raises if it has been overwritten or not made yet)."""
        c = version % 2
        if self.held[c] != version:
            raise RuntimeError(f"weight version {version} is not held (copies: {self.held})")
        return self.copies[c]

    @property
    def current_model(self) -> Transformer:
        """The copy holding the latest version (evaluation and sampling use it)."""
        return self.model(self.latest)

    def unsharded(self) -> AbstractContextManager:
        return nullcontext()  # each copy holds its parameters whole

    def seal(self, step: int) -> list[Tensor]:
        """Take step `step`'s accumulated gradients off its copy, so the next step starts at
        zero; every backward of the step on this rank is done (STEP follows them)."""
        grads, c = [], weights_of(step) % 2
        for i, p in enumerate(self.params[c]):
            grads.append(torch.zeros_like(p) if p.grad is None else p.grad)
            p.grad = None
            self.memory.release(f"grad:{c}:{i}")  # the copy's next gradients are another's
            self.memory.track(f"sealed:{step}:{i}", "gradients", grads[-1], transient=True)
        return grads

    def take(self, step: int, grads: list[Tensor], busy: set[int]) -> None:
        """The stream, at step `step`'s update point: its sealed gradients, and the versions
        in-flight micro-batches still use (the update must not overwrite one of them)."""
        if step != self.latest:
            raise RuntimeError(f"update of step {step} but the latest version is {self.latest}")
        self._grads, self._busy = grads, busy
        self._stepped = step

    # -- the optimizer-engine surface ------------------------------------------------------
    def begin_step(self) -> None:
        self.memory.begin_step()

    def micro_batch(self, is_last: bool) -> None:
        pass  # the stream accumulates on the copy each micro-batch ran with

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def finish(self) -> None:
        """Average the step's gradients over dp (one flat all-reduce)."""
        self.comm.all_reduce_flat(self._grads, "dp", op="avg", tag="grad")
        self._coef = 1.0

    def grad_pieces(self) -> list[tuple[nn.Parameter, Tensor]]:
        """Keyed by copy 0's parameters: the split rules were found on that copy."""
        return list(zip(self.params[0], self._grads, strict=True))

    def grad_norm(self, rules: SplitGradRules) -> Tensor:
        return rules.norm(self.grad_pieces(), self.comm)

    def clip(self, coef: float) -> None:
        self._coef = float(coef)

    def step(self, lr: float) -> bool:
        """Produce version k+1 from version k and step k's gradients: W(k) is copied into the
        copy that held W(k-1) (free by then), and one AdamW step updates it there."""
        step, target = self.latest, (self.latest + 1) % 2
        if self.held[target] in self._busy:
            raise RuntimeError(f"version {self.held[target]} is still in use: cannot replace it")
        with torch.no_grad():
            for g in self._grads:
                g.mul_(self._coef)
            for dst, src in zip(self.params[target], self.params[step % 2], strict=True):
                dst.copy_(src)
        self.optimizer.step(self.params[target], self._grads, step + 1, lr)
        self.held[target], self.latest = step + 1, step + 1
        return True

    def zero_grad(self) -> None:
        self._grads = None  # sealed gradients were taken off the copies already
        for i in range(len(self.params[0])):
            self.memory.release(f"sealed:{self._stepped}:{i}")

    # -- checkpoints -----------------------------------------------------------------------
    saved_states = ("master", "exp_avg", "exp_avg_sq", "previous")
    replicated = True  # no ZeRO under 2BW: every dp rank holds the same versions
    scaler = None  # fp32 only

    @property
    def step_count(self) -> int:
        """Updates taken: version `latest` is the weights after that many."""
        return self.latest

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """Copy 0's parameters by name: the split rules were found on copy 0."""
        return dict(zip(self.names, self.params[0], strict=True))

    def state_dict(self) -> dict[str, Any]:
        """At a step boundary: `master` is the newest version W(k), `previous` is W(k-1), the
        weights step k's micro-batches run with (the next update's gradients), and the Adam
        moments. Micro-batches of step k already in flight are not state: a resumed stream
        runs them again on W(k-1), to the same bits."""
        newest, older = self.latest % 2, (self.latest - 1) % 2
        previous = dict(zip(self.names, self.params[older], strict=True))
        pieces = self.optimizer.pieces(self.params[newest])
        for piece in pieces:
            piece.tensors["previous"] = previous[piece.name].detach().reshape(-1).clone()
        return {"step": self.latest, "loss_scaler": None, "pieces": pieces}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at step `state["step"]`: copy k % 2 holds W(k) and the other W(k-1). A
        checkpoint without `previous` (saved by a synchronous schedule) starts the versions
        as a run starts them: both copies hold the saved weights."""
        k = int(state["step"])
        newest, older = k % 2, (k - 1) % 2
        saved = state["params"]
        self.optimizer.load(self.params[newest], saved)  # W(k) and the moments
        for name, p in zip(self.names, self.params[older], strict=True):
            p.copy_(saved[name].get("previous", saved[name]["master"]))
        self.held = [k, k - 1] if newest == 0 else [k - 1, k]
        self.latest = k

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def storages(self) -> int:
        """Distinct parameter storages on this rank (the optimizer's masters are views of
        the copies, never a third one): measured memory."""
        return len({p.untyped_storage().data_ptr() for ps in self.params for p in ps})
