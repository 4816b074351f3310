"""Estimate vs measurement: run a layout for real, read the memory tracker, compare.

Shared by the tests that hold the estimate to the meter (tests/test_estimate_measured.py,
test_lora_estimate.py, test_zero_pipelines.py) and benchmarks/bench_memory.py (the table of
docs/memory.md, whose layouts are tests/memory_table.py's list). `measure` runs on every rank
of a harness world; `compare` lines its result up with `plait.estimate` for that rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.build.corpus import load_corpus
from plait.config import Config
from plait.device import peak_allocated_bytes
from plait.estimate import Estimate, RankEstimate
from plait.estimate.activations import MicroShape, target_rows_bytes
from plait.estimate.model_states import ElementBytes
from plait.memory_tracker import MODEL_STATES, PLACES
from plait.mesh import build_mesh
from plait.models.loss import IGNORE
from plait.train import Trainer
from reference import corpus_for
from sections import build_regrouped

MB, SEQ = 2, 64


@dataclass(frozen=True)
class Case:
    """One layout of the table: a name and the config overrides that make it."""

    name: str
    preset: str = "small-gpt"
    parallel: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    accum: int = 2
    steps: int = 2  # the run's steps; the second is measured (2BW: 4, so it is mid-stream)
    packed: bool = False  # instruction data: an examples folder's packed rows (vocabulary 400)

    @property
    def world(self) -> int:
        p = self.parallel
        return p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)

    def config(self, offload_dir: str | None = None, examples: str | None = None) -> Config:
        """The layout's config; a packed case reads the examples folder `examples`."""
        par = {"bucket_mb": 0.25, "comm_timeout": 60, **self.parallel}
        if par.get("offload") == "nvme":
            par["offload_dir"] = offload_dir
        dp = par.get("dp", 1)
        train = {"micro_batch": MB, "global_batch": MB * self.accum * dp, "seq_len": SEQ}
        train |= {
            "steps": self.steps,
            "progress": False,
            "eval_every": 0,
            "out": "/tmp/plait-unused",
        }
        model, data = dict(self.model), {"max_bytes": 300_000}
        if self.packed:
            model["vocab_size"], data["path"] = 400, examples
        over = {"model": model, "parallel": par, "data": data}
        cfg = build_regrouped(self.preset, over | {"train": train})
        cfg.validate()
        return cfg


def measure(
    case: Case, offload_dir: str | None = None, examples: str | None = None
) -> dict[str, Any]:
    """This rank's memory in the second step (the first allocates lazily): model states by
    category and place, the peak of saved activations, buffers and the total; for packed
    rows also what the estimate's every-position-a-target head counts beyond the measured
    micro-batches' targets (`no_target_bytes`)."""
    cfg = case.config(offload_dir and str(Path(offload_dir) / "nvme"), examples)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    corpus = load_corpus(cfg) if case.packed else corpus_for(cfg)
    drawn = _Counted(corpus.train)
    trainer = Trainer(cfg, mesh, dataclasses.replace(corpus, train=drawn))
    tracker = trainer.engine.memory
    trainer.train_step()
    drawn.targets.clear()
    trainer.train_step(meter_activations=True)
    states = {c: {p: tracker.persistent(c, p) for p in PLACES} for c in MODEL_STATES}
    last = mesh.coord.pp == cfg.parallel.pp - 1  # the stage with the loss
    out = {
        "pp_rank": mesh.coord.pp,
        "states": states,
        "activations": tracker.peak("activations"),
        "comm_buffers": tracker.peak("comm_buffers"),
        "total": tracker.peak(),
        "allocator_peak": peak_allocated_bytes(mesh.device),
        "comm": trainer.comm.stats.as_rows(),  # the second step's collectives
        "frozen_base": frozen_bytes(trainer),
        "no_target_bytes": no_target_bytes(cfg, drawn.targets) if case.packed and last else 0,
    }
    trainer.close()
    return out


class _Counted:
    """Training rows that remember each drawn micro-batch's target count."""

    def __init__(self, rows: Any) -> None:
        self.rows, self.targets = rows, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rows, name)

    def __len__(self) -> int:
        return len(self.rows)

    def draw(self, idx: torch.Tensor):
        x, y, seg = self.rows.draw(idx)
        self.targets.append(int((y != IGNORE).sum()))
        return x, y, seg


def no_target_bytes(cfg: Config, targets: list[int]) -> int:
    """The lighter loss saves per target row only (models/light_loss.py); the estimate
    counts every position (it cannot know the data's targets). The last stage holds one
    micro-batch's loss at a time, and the one with the most targets makes the peak: the
    estimate's excess is its rows without a target."""
    par, t = cfg.parallel, cfg.train
    e = ElementBytes.of(cfg.train.precision, cfg.train.reduce_dtype).param
    x = MicroShape(t.micro_batch, t.seq_len, par.tp, par.sequence_parallel, e)
    return target_rows_bytes(cfg.model, x) - target_rows_bytes(cfg.model, x, max(targets))


def frozen_bytes(trainer: Trainer) -> int:
    """Bytes of the parameters that do not train (a LoRA run's base), each storage once,
    counted off the model: a check of the base's dtype apart from the tracker (which the
    ZeRO engine tells of the base, under parameters: zero/frozen.py). Under ZeRO-3 the
    model's views of the base have no storage between uses: the engine's shards instead."""
    gatherer = getattr(trainer.engine, "frozen_gatherer", None)
    nf4 = getattr(trainer.engine, "nf4_weights", {})  # an NF4 base: its codes and constants
    if gatherer is not None:
        held = sum(s.numel() * s.element_size() for s in gatherer.store.shards)
        packed = getattr(trainer.engine, "nf4_gatherer", None)  # ZeRO-3: the bytes' shards,
        if packed is not None:  # the nested scales and offsets whole
            held += sum(s.numel() for s in packed.store.shards)
            held += sum(4 * h.weight.nested.numel() + 4 for h in nf4.values())
        return held
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in trainer.model.parameters() if not p.requires_grad}  # fmt: skip
    return sum(storages.values()) + sum(h.weight.nbytes for h in nf4.values())


def compare(est: Estimate, measured: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(estimate, measured) per compared term for the rank that was measured.

    The total compares what the tracker sees: model states, activations and the ZeRO
    buffers (pipeline receive buffers are plain runtime tensors it does not register)."""
    rank = est.ranks[measured["pp_rank"]]
    out = {}
    for c in MODEL_STATES:
        line = rank.line(c)
        est_bytes = line.device + line.host + line.disk
        if c == "parameters":  # the ZeRO engine registers a frozen base as parameters
            est_bytes += rank.frozen()
        out[c] = (est_bytes, sum(measured["states"][c].values()))
    excess = measured.get("no_target_bytes", 0)  # packed rows: positions without a target
    out["activations"] = (rank.line("activations").device - excess, measured["activations"])
    if rank.frozen() or measured["frozen_base"]:
        out["frozen_base"] = (rank.frozen(), measured["frozen_base"])
    out["total"] = (rank.total() - untracked(rank) - excess, measured["total"])
    return out


def untracked(rank: RankEstimate) -> int:
    """Estimated bytes the tracker cannot see (pipeline receive buffers)."""
    return rank.line("pipeline_buffers").device


def error(pair: tuple[int, int]) -> float:
    est, meas = pair
    return 0.0 if est == meas else (est - meas) / max(meas, 1)
