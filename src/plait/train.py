"""The Trainer: the handle on one rank's built run, which steps, evaluates and checkpoints it.

Building the rank is `build/rank.py`'s `build_rank` (corpus, first weights, model,
parallelization, engine and runner, in that order); one step is `step.py`'s `Step`; saving and
loading are `checkpoint/run_state.py`'s. The Trainer holds the parts and where the run stands
(its step, `--keep-best`'s best validation so far).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from torch import nn

from plait.build.rank import build_rank
from plait.checkpoint.run_state import RunCheckpoints
from plait.config import Config
from plait.data.batches import Corpus
from plait.mesh import Mesh
from plait.step import Step, StepResult, evaluate_loss


class Trainer:
    """One rank's share of a training run: `train_step()` runs the next optimizer step."""

    def __init__(self, cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> None:
        self.parts = parts = build_rank(cfg, mesh, corpus)
        self.cfg, self.mesh, self.comm, self.corpus = cfg, mesh, parts.comm, parts.corpus
        self.engine, self.batches, self.grad_rules = parts.engine, parts.batches, parts.grad_rules
        self.pipeline, self.stream = parts.pipeline, parts.stream  # stream: 2BW's runner
        self._step = Step(parts.engine, parts.runner, parts.grad_rules, parts.comm, cfg.train,
                          cfg.optim)  # fmt: skip
        self.checkpoints = RunCheckpoints(parts, cfg, cfg.checkpoint.keep_checkpoints)
        self.step = 0
        self.best: dict[str, Any] | None = None  # --keep-best: {"step", "val_loss"} so far

    @property
    def model(self) -> nn.Module:
        """This rank's part of the model with the newest weights (2BW: its latest version)."""
        return self.engine.current_model

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def train_step(self, meter_activations: bool = False) -> StepResult:
        """One optimizer step over one global batch; returns the global mean loss.

        `meter_activations`: count the bytes autograd saves for backward during the step
        (the memory tracker's `activations` peak). Off by default: the hook on every saved
        tensor costs time (about 1 ms a step on the lessons' CPU models, 3-20% of their step,
        more the more is saved), and the step is the same code either way."""
        memory = self.engine.memory
        meter = memory.activations() if meter_activations and memory else nullcontext()
        with meter:
            result = self._step(self.step)
        self.step += 1
        return result

    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows, split across replicas."""
        batches = self.batches.validation(self.cfg.train.eval_batches)
        return evaluate_loss(self.model, batches, self.comm, self.pipeline)

    def save(self, out: Path, before_commit: Callable[[], None] | None = None) -> dict[str, float]:
        """Write `out/checkpoints/step-N` (collective) and keep the newest ones."""
        return self.checkpoints.save(out, self.step, self.best, before_commit)

    def load(self, path: Path) -> None:
        """Continue from a checkpoint written under any layout (collective)."""
        state = self.checkpoints.load(path)
        self.step = state["step"]
        self.best = state.get("best")
        if self.stream:  # 2BW: the stream goes on from the loaded versions
            self.stream.start_at(self.step)

    def load_weights(self, path: Path) -> dict[str, Any]:
        """The parameters and optimizer state of a checkpoint of any layout (collective), not
        where its run stood (`plait eval` reads other data); returns its trainer state."""
        return self.checkpoints.load_weights(path)

    def close(self) -> None:
        self.engine.close()
