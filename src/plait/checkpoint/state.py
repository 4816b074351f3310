"""What a rank writes and reads: its boxes of the model's training state, by single-process name.

Every tensor of a checkpoint is `"<state>/<parameter name>"` with the single-process shape,
where state is `master` (the fp32 weights), `exp_avg` or `exp_avg_sq`: nothing in it depends
on dp, tp, pp, the ZeRO stage, the bucket size or offload. The compute-dtype parameters are
not saved; they are the masters cast.

Writing: each element is written by exactly one rank, the same rule by which the global
gradient norm counts each parameter once (`SplitRules.uncounted`: tp-replicated parameters
by tp rank 0, a tied embedding by the first stage) plus data parallelism: at stage 0 dp rank
0 writes, from stage 1 on each rank writes its own shard. `torch.distributed.checkpoint`
checks that the boxes tile every tensor exactly and writes them in parallel.

Reading: a rank asks for the full tensor of every parameter it holds (the checkpoint reader
assembles it from whichever boxes overlap) and keeps its slice: its tp shard, then its ZeRO
pieces (`ZeroEngine.load_state_dict`). A rank therefore briefly holds the full fp32 state
of its own pipeline stage's parameters, one stage at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from plait.checkpoint.boxes import Box, range_boxes, to_global
from plait.comm import Comm
from plait.mesh import Mesh
from plait.parallel.grads import SplitRules
from plait.parallel.tp.sharding import ShardSpec, param_shard_specs
from plait.parallel.zero.engine import ZeroEngine


def canonical(name: str, model: nn.Module) -> str:
    """The single-process name: a pipeline's last stage calls its tied copy `head.weight`."""
    if name == "head.weight" and getattr(model.cfg, "tie_embeddings", False):
        return "embed.tok.weight"
    return name


def state_names(engine: ZeroEngine) -> tuple[str, ...]:
    return ("master", *engine.optimizer.state_names)


def _params_by_name(engine: ZeroEngine) -> dict[str, nn.Parameter]:
    return {n: p for g in engine.groups for n, p in zip(g.names, g.params, strict=True)}


def owned_boxes(
    engine: ZeroEngine, model: nn.Module, rules: SplitRules, mesh: Mesh
) -> dict[str, list[tuple[Box, Tensor]]]:
    """`"<state>/<name>"` -> the (global box, data) this rank writes."""
    if engine.stage == 0 and mesh.coord.dp != 0:
        return {}
    specs, params = param_shard_specs(model), _params_by_name(engine)
    out: dict[str, list[tuple[Box, Tensor]]] = {}
    for piece in engine.state_dict()["pieces"]:
        if id(params[piece.name]) in rules.uncounted:
            continue
        for box in range_boxes(piece.shape, piece.start, piece.length):
            placed = to_global(box, specs.get(piece.name))
            if placed is None:
                continue
            for state, values in piece.tensors.items():
                data = values[box.start : box.start + placed.numel].view(placed.sizes)
                key = f"{state}/{canonical(piece.name, model)}"
                out.setdefault(key, []).append((placed, data))
    return out


def global_shapes(engine: ZeroEngine, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Single-process name -> single-process shape, for every parameter this rank holds."""
    specs = param_shard_specs(model)
    return {
        canonical(n, model): (specs[n].global_shape if n in specs else tuple(p.shape))
        for n, p in _params_by_name(engine).items()
    }


def sharded_state(
    boxes: dict[str, list[tuple[Box, Tensor]]], shapes: dict[str, tuple[int, ...]], comm: Comm
) -> dict[str, ShardedTensor | Tensor]:
    """The boxes as ShardedTensors, each with every rank's shard metadata (one gather of the
    box lists); the checkpoint planner checks that they tile each tensor exactly. A single
    process owns every box and writes plain tensors (no process group to shard over)."""
    mesh = comm.mesh
    if mesh.world_size == 1:
        return {key: _whole(parts, shapes[key.split("/", 1)[1]]) for key, parts in boxes.items()}
    mine = {key: [(box, str(data.device)) for box, data in parts] for key, parts in boxes.items()}
    everyone = comm.all_gather_object(mine, "world", tag="checkpoint-plan")
    out = {}
    for key, parts in boxes.items():
        name = key.split("/", 1)[1]
        shards = [
            Shard(data.contiguous(), _metadata(box, str(data.device), mesh.rank))
            for box, data in parts
        ]
        every = [
            _metadata(box, device, rank)
            for rank, theirs in enumerate(everyone)
            for box, device in theirs.get(key, [])
        ]
        meta = ShardedTensorMetadata(
            shards_metadata=every,
            size=torch.Size(shapes[name]),
            tensor_properties=TensorProperties(dtype=parts[0][1].dtype),
        )
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
    return out


def _whole(parts: list[tuple[Box, Tensor]], shape: tuple[int, ...]) -> Tensor:
    full = torch.empty(shape, dtype=parts[0][1].dtype)
    for box, data in parts:
        full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))] = data
    return full


def _metadata(box: Box, device: str, rank: int) -> ShardMetadata:
    return ShardMetadata(list(box.offsets), list(box.sizes), f"rank:{rank}/{device}")


def full_request(engine: ZeroEngine, model: nn.Module) -> dict[str, Tensor]:
    """Empty full fp32 tensors for every state of every parameter this rank holds."""
    return {
        f"{state}/{name}": torch.empty(shape, dtype=torch.float32)
        for name, shape in global_shapes(engine, model).items()
        for state in state_names(engine)
    }


def local_states(
    loaded: dict[str, Tensor], engine: ZeroEngine, model: nn.Module
) -> dict[str, dict[str, Tensor]]:
    """This rank's name -> state -> its tp slice (padding zero), for `load_state_dict`."""
    specs = param_shard_specs(model)
    out: dict[str, dict[str, Tensor]] = {}
    for name in _params_by_name(engine):
        out[name] = {
            state: _slice(loaded[f"{state}/{canonical(name, model)}"], specs.get(name))
            for state in state_names(engine)
        }
    return out


def _slice(full: Tensor, spec: ShardSpec | None) -> Tensor:
    if spec is None:
        return full
    local = torch.zeros(spec.shape, dtype=full.dtype)
    spec.unpadded(local).copy_(full[spec.region()])
    return local
