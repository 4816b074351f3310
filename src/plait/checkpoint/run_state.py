"""A run's checkpoints of one rank: what continues the run, saved beside the tensors, and
loaded back into a rank of any layout.

The tensors are the engine's (`io.py`: the trainable parameters' masters and optimizer
states, by single-process name); beside them `trainer.json` holds where the run stood: the
step, the sampler's position, the engine's step count and loss scaler, the configuration, a
LoRA run's base (named, not copied: `base.py`) and `--keep-best`'s best validation so far.
Dropout, LoRA's adapter dropout included, is keyed by (seed, step, sample)
(models/dropout.py), so no random-generator state is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from plait.checkpoint import base as ckpt_base
from plait.checkpoint import io as ckpt_io
from plait.checkpoint import store
from plait.comm import Comm
from plait.parallel.grads import SplitGradRules
from plait.parallel.optimizer_engine import OptimizerEngine


class Sampler(Protocol):
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Batches(Protocol):
    """The run's batches (data/batches.py StepBatches): where the sampler stands."""

    sampler: Sampler

    def position(self, step: int) -> dict[str, Any]: ...


class Held(Protocol):
    """What a checkpoint saves and loads of a built rank (build/rank.py's RankParts)."""

    engine: OptimizerEngine
    model: nn.Module
    grad_rules: SplitGradRules
    comm: Comm
    batches: Batches


class Described(Protocol):
    """A run's configuration (config.py's Config): saved in every checkpoint."""

    def to_dict(self) -> dict[str, Any]: ...


class RunCheckpoints:
    """Save `rank`'s share of the run under `OUT/checkpoints/step-N` (keeping the newest
    `keep`), or load one written under any layout. Every method is collective."""

    def __init__(self, rank: Held, config: Described, keep: int) -> None:
        self.rank, self.config, self.keep = rank, config, keep
        self.base = ckpt_base.base_record(config.to_dict())  # a LoRA run's frozen base, named

    def state(self, step: int, best: dict[str, Any] | None) -> dict[str, Any]:
        """What continues the run besides the tensors (the same on every rank). A LoRA run's
        tensors are its adapters alone (the engines save only trainable parameters) and
        "base" names the frozen base they need instead of copying it (base.py); "best" is
        `--keep-best`'s {"step", "val_loss"} so far."""
        engine = self.rank.engine
        scaler = engine.scaler.state_dict() if engine.scaler else None
        state = {
            "step": step,
            "sampler": self.rank.batches.position(step),
            "engine_step": engine.step_count,
            "loss_scaler": scaler,
            "config": self.config.to_dict(),
        }
        if self.base is not None:
            state["base"] = self.base
        if best is not None:
            state["best"] = best
        return state

    def save(
        self,
        out: Path,
        step: int,
        best: dict[str, Any] | None,
        before_commit: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Write `out/checkpoints/step-N` and keep the newest ones; returns {"path",
        "seconds", "bytes"}. `before_commit` runs between the write and the commit."""
        r = self.rank
        path = store.step_dir(out, step)
        stats = ckpt_io.save(path, r.engine, r.model, r.grad_rules, r.comm,
                             self.state(step, best), before_commit)  # fmt: skip
        if r.comm.mesh.rank == 0:
            store.prune(out, self.keep)
        return {"path": str(path), **stats}

    def load(self, path: Path) -> dict[str, Any]:
        """Continue from a checkpoint written under any layout: the same adapters and base
        as this run's (base.py), the tensors, the sampler's position. Returns the trainer
        state, whose "step" and "best" the caller takes on."""
        state = store.read_trainer(path)
        ckpt_base.check_same_adapters_and_base(path, state, self.config.to_dict())
        state = self.load_weights(path)
        self.rank.batches.sampler.load_state_dict(state["sampler"])
        return state

    def load_weights(self, path: Path) -> dict[str, Any]:
        """The parameters and optimizer state of a checkpoint of any layout, not where its
        run stood (`plait eval` reads other data); returns its trainer state."""
        state = store.read_trainer(path)
        ckpt_io.load(path, self.rank.engine, self.rank.model, self.rank.comm, state)
        return state
