"""Save and load one rank's share of a training run (collective over every rank).

`save` writes this rank's boxes (`state.py`) with `torch.distributed.checkpoint`, then rank 0
commits the folder (`store.py`); nobody goes on before the commit. `load` reads the full
state of the parameters this rank holds, from whatever layout wrote it, and hands the
engine its slices. The byte traffic of these collectives belongs to the checkpoint library,
not to a training step, so `comm.py` does not count it.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from plait.checkpoint.state import (
    full_request,
    global_shapes,
    local_states,
    owned_boxes,
    sharded_state,
)
from plait.checkpoint.store import write_manifest
from plait.comm import Comm
from plait.parallel.grads import SplitGradRules
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.signals import pause_at


def save(
    path: Path,
    engine: OptimizerEngine,
    model: nn.Module,
    rules: SplitGradRules,
    comm: Comm,
    trainer_state: dict[str, Any],
    before_commit: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Write and commit a checkpoint at `path`; returns {"seconds", "bytes"} (bytes: rank 0).
    `before_commit` runs on every rank between the write and the commit (a test's fault)."""
    start = time.perf_counter()
    mesh = comm.mesh
    if mesh.rank == 0 and path.exists():  # an unfinished save of this step: start over
        shutil.rmtree(path)
    comm.barrier()
    boxes = owned_boxes(engine, model, rules, mesh)
    state = sharded_state(boxes, global_shapes(engine, model), comm)
    dcp = dcp_module()
    with one_process_is_fine():
        dcp.save(state, checkpoint_id=str(path), no_dist=mesh.world_size == 1)
    if before_commit is not None:
        before_commit()
    pause_at("save", f"rank{mesh.rank}")  # written, not committed: a test's signal comes here
    comm.barrier()  # every rank's file is written
    nbytes = write_manifest(path, trainer_state) if mesh.rank == 0 else 0
    comm.barrier()  # committed before anyone goes on
    return {"seconds": time.perf_counter() - start, "bytes": float(nbytes)}


def load(
    path: Path, engine: OptimizerEngine, model: nn.Module, comm: Comm, trainer_state: dict[str, Any]
) -> None:
    """Fill the engine (masters, moments, step count, loss scaler) and the parameters."""
    request = full_request(engine, model, set(saved_shapes(path)))
    dcp = dcp_module()
    with one_process_is_fine():
        dcp.load(request, checkpoint_id=str(path), no_dist=comm.mesh.world_size == 1)
    engine.load_state_dict(
        {
            "params": local_states(request, engine, model),
            "step": trainer_state["engine_step"],
            "loss_scaler": trainer_state.get("loss_scaler"),
        }
    )


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds, by key, with its single-process shape (DCP's own
    metadata: nothing of plait's is unpickled)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp_module().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        key: tuple(m.size) for key, m in metadata.items() if isinstance(m, TensorStorageMetadata)
    }


def dcp_module() -> Any:
    """`torch.distributed.checkpoint`, imported at the first save or load: importing it
    (DTensor, sympy) takes about a second, which every `plait` process paid at start-up,
    the launcher and each command that never touches a checkpoint included."""
    import torch.distributed.checkpoint as dcp

    return dcp


@contextmanager
def one_process_is_fine() -> Iterator[None]:
    """DCP warns that it works without a process group; for a world of one that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
