"""What `bench_ckpt.py` times: plait's `Trainer.save` / `Trainer.load` and the floor under
them, `torch.distributed.checkpoint` (DCP) of the same training state as plain tensors.

The floor writes exactly the elements plait writes, so both sides move the same bytes and
the difference is plait's own machinery (boxes, the plan gather, ShardedTensor metadata,
the tiling check, the manifest with its SHA-256, the resharding read). Every rank takes the
fp32 master and AdamW moments of each parameter piece its ZeRO engine holds, as views of
the engine's flat buffers (no copy), under a rank-prefixed name with the local 1-D shape:
no global shape, no boxes, no dedup or resharding by DCP. A piece held by several ranks
(a data-parallel replica at ZeRO stage 0, a tensor-parallel-replicated parameter, the tied
embedding on both pipeline ends) is written once, by the lowest rank holding it, and read
back by every holder from that rank's name: the owners are fixed once, before any timing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

import common
from common import gather_objects, max_over_ranks
from plait.checkpoint import io as ckpt_io
from plait.checkpoint import store
from plait.config import Config, build_config
from plait.mesh import build_mesh
from plait.models.contract import contract_of
from plait.models.transformer import Transformer
from plait.parallel.tp.sharding import param_shard_specs
from plait.train import Trainer

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2-zero3": {"dp": 2, "zero": 3},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "pp2-1f1b": {"pp": 2, "schedule": "1f1b"},
}
"""The layouts compared, each in its own world of dp x tp x pp ranks."""


def world_of(layout: str) -> int:
    par = LAYOUTS[layout]
    return par.get("dp", 1) * par.get("tp", 1) * par.get("pp", 1)


def make_config(layout: str, opts: Any) -> Config:
    """The Trainer config of one layout: the preset, fp32, no dropout, no evaluation."""
    train = {
        "steps": 10_000,  # only sets the lr schedule's length
        "micro_batch": opts.micro_batch,
        "global_batch": opts.global_batch,
        "seq_len": opts.seq_len,
        "eval_every": 0,
        "seed": opts.seed,
    }
    par = dict(LAYOUTS[layout])
    over = {
        "model": {"dropout": 0.0},
        "parallel": par,
        "memory": {"zero": par.pop("zero")} if "zero" in par else {},
        "data": {"max_bytes": opts.max_bytes},
        "train": train,
        "log": {"progress": False, "out": "/tmp/plait-bench-ckpt-unused"},
    }
    cfg = build_config(opts.preset, over)
    cfg.validate()
    return cfg


def make_trainer(cfg: Config, corpus: Any, steps: int) -> Trainer:
    """A Trainer after `steps` optimizer steps, so its moments hold real values."""
    trainer = Trainer(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu")), corpus)
    for _ in range(steps):
        trainer.train_step()
    return trainer


def param_count(cfg: Config) -> int:
    """Single-process parameter count (the tied embedding once), built on meta."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the floor's state dict
def local_pieces(trainer: Trainer) -> list[tuple[tuple, dict[str, Tensor]]]:
    """(identity, state -> 1-D view) of every parameter piece this rank's engine holds.

    The identity is what makes two ranks' pieces the same elements: the single-process
    name, the tensor-parallel rank for a sharded parameter, and the flat range."""
    engine, model = trainer.engine, trainer.model
    specs, tp = param_shard_specs(model), trainer.mesh.coord.tp
    names = engine.saved_states
    out = []
    for g in engine.groups:
        flat = engine.states.states[g.index]
        for piece in g.pieces():
            name = g.names[piece.param]
            key = contract_of(model).canonical(name)
            ident = (key, tp if name in specs else -1, piece.start, piece.length)
            lo, hi = piece.shard_offset, piece.shard_offset + piece.length
            out.append((ident, {s: flat[s][lo:hi] for s in names}))
    return out


def floor_state_dicts(trainer: Trainer) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(what this rank saves, what it loads): plain tensors under the owner's rank prefix.

    The owner of a piece is the lowest rank holding it (one all_gather_object, untimed)."""
    pieces = local_pieces(trainer)
    owner: dict[tuple, int] = {}
    for rank, idents in enumerate(gather_objects([ident for ident, _ in pieces])):
        for ident in idents:
            owner.setdefault(ident, rank)
    me = dist.get_rank()
    save: dict[str, Tensor] = {}
    load: dict[str, Tensor] = {}
    for ident, views in pieces:
        name, _, start, length = ident
        for state, view in views.items():
            key = f"rank{owner[ident]}/{state}/{name}/{start}+{length}"
            load[key] = view
            if owner[ident] == me:
                save[key] = view
    return save, load


def held_bytes(trainer: Trainer) -> int:
    """Bytes of every state this rank holds, replicas included (what a naive dump writes)."""
    return sum(v.numel() * v.element_size() for _, views in local_pieces(trainer)
               for v in views.values())  # fmt: skip


# ---------------------------------------------------------------- sides
class CallSide(common.Side):
    """One timed call (a save or a load) of one side; `prepare` runs untimed before it."""

    def __init__(
        self,
        name: str,
        call: Callable[[], Mapping[str, float]],
        prepare: Callable[[], None] = lambda: None,
        phases: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, phases)
        self.call, self.prepare = call, prepare


def call_step(side: CallSide) -> tuple[float, Mapping[str, Any]]:
    """Prepare, line the ranks up, time the call on every rank; the figure is the max over
    ranks (taken after the timed region, as every benchmark here does)."""
    side.prepare()
    dist.barrier()
    start = time.perf_counter()
    extra = side.call()
    seconds = time.perf_counter() - start
    return max_over_ranks(seconds), {k: max_over_ranks(v) for k, v in extra.items()}


def fresh(folder: Path) -> Callable[[], None]:
    """Remove the previous save before the next one (rank 0, untimed): both sides always
    write into a folder that does not exist, and plait's own rmtree of an unfinished save
    stays out of its figure."""

    def prepare() -> None:
        if dist.get_rank() == 0 and folder.exists():
            shutil.rmtree(folder)
        dist.barrier()

    return prepare


SAVE_PHASES = ("boxes", "plan", "dcp", "manifest", "prune", "own_clock")
"""Where `Trainer.save` spends its time: this rank's boxes (`owned_boxes`, with the engine's
state export), the ShardedTensors with every rank's plan (`sharded_state`, one gather),
`dcp.save`, rank 0's manifest with SHA-256 and marker, the pruning, and the `seconds` it
returns (everything but the pruning)."""
LOAD_PHASES = ("request", "dcp", "slices", "engine")
"""Where `Trainer.load` spends it: the empty full tensors (`full_request`), `dcp.load`, this
rank's tp slices (`local_states`) and `ZeroEngine.load_state_dict`."""


class PhaseClock:
    """Seconds spent in named plait functions during one call, by wrapping them where
    `plait.checkpoint.io`, `Trainer.save` and the engine look them up (in this process only:
    src is untouched, and the floor's `dcp` calls are not wrapped)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)

    def take(self, phases: tuple[str, ...]) -> dict[str, float]:
        """This call's seconds per phase (0 for one not entered), and start over."""
        out = {p: self.spent.get(p, 0.0) for p in phases}
        self.spent.clear()
        return out


def instrument(trainer: Trainer) -> PhaseClock:
    """Wrap the functions of SAVE_PHASES and LOAD_PHASES; `ckpt_io.dcp` becomes a namespace of
    its own, so the wrapped save and load are plait's calls alone."""
    clock = PhaseClock()
    ckpt_io.dcp = SimpleNamespace(save=dcp.save, load=dcp.load)
    for owner, attr, phase in [
        (ckpt_io, "owned_boxes", "boxes"), (ckpt_io, "sharded_state", "plan"),
        (ckpt_io.dcp, "save", "dcp"), (ckpt_io, "write_manifest", "manifest"),
        (store, "prune", "prune"), (ckpt_io, "full_request", "request"),
        (ckpt_io.dcp, "load", "dcp"), (ckpt_io, "local_states", "slices"),
        (trainer.engine, "load_state_dict", "engine"),
    ]:  # fmt: skip
        clock.wrap(owner, attr, phase)
    return clock


def make_sides(trainer: Trainer, root: Path) -> list[tuple[CallSide, CallSide]]:
    """(plait save, floor save) and (plait load, floor load): the two pairs of one world."""
    plait_out, floor_dir = root / "plait", root / "floor"
    plait_path = plait_out / "checkpoints" / f"step-{trainer.step}"
    to_save, to_load = floor_state_dicts(trainer)
    clock = instrument(trainer)

    def plait_save() -> dict[str, float]:
        seconds = trainer.save(plait_out)["seconds"]
        return {**clock.take(SAVE_PHASES[:-1]), "own_clock": seconds}

    def plait_load() -> dict[str, float]:
        trainer.load(plait_path)
        return clock.take(LOAD_PHASES)

    def floor_save() -> dict[str, float]:
        dcp.save(to_save, checkpoint_id=str(floor_dir))
        return {}

    def floor_load() -> dict[str, float]:
        dcp.load(to_load, checkpoint_id=str(floor_dir))
        return {}

    return [
        (
            CallSide("plait save", plait_save, fresh(plait_path), SAVE_PHASES),
            CallSide("floor save", floor_save, fresh(floor_dir)),
        ),
        (
            CallSide("plait load", plait_load, phases=LOAD_PHASES),
            CallSide("floor load", floor_load),
        ),
    ]


# ---------------------------------------------------------------- what is on disk
def folder_facts(path: Path) -> dict[str, Any]:
    """Bytes on disk (total, per rank's `__R_0.distcp`, DCP's `.metadata`, the rest) and
    what DCP's metadata lists: tensors and chunks (boxes), and their data bytes."""
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    ranks = sorted((n for n in files if n.endswith(".distcp")), key=_rank_of)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    chunks = [c for m in meta.values() for c in m.chunks]
    data = sum(
        torch.Size(c.sizes).numel() * m.properties.dtype.itemsize
        for m in meta.values()
        for c in m.chunks
    )
    return {
        "total_bytes": sum(files.values()),
        "per_rank_bytes": [files[n] for n in ranks],
        "metadata_bytes": files.get(".metadata", 0),
        "other_bytes": {n: b for n, b in files.items() if n not in ranks and n != ".metadata"},
        "tensors": len(meta),
        "chunks": len(chunks),
        "tensor_data_bytes": data,
    }


def _rank_of(name: str) -> int:
    return int(name.removeprefix("__").split("_")[0])
