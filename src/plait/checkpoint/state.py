"""What a rank writes and reads: its boxes of the model's training state, by single-process name.

Every tensor of a checkpoint is `"<state>/<parameter name>"` with the single-process shape
(names, shapes, tp shards and tied copies' canonical names all from the model's contract),
where state is `master` (the fp32 weights), `exp_avg` or `exp_avg_sq` (and 2BW's `previous`
weight version, `parallel/pipeline/weight_versions.py`): nothing in it depends
on dp, tp, pp, the ZeRO stage, the bucket size or offload. The compute-dtype parameters are
not saved; they are the masters cast.

Writing: each element is written by exactly one rank, the same rule by which the global
gradient norm counts each parameter once (`SplitGradRules.uncounted`: tp-replicated parameters
by tp rank 0, a tied embedding by the first stage) plus data parallelism: at stage 0 dp rank
0 writes, from stage 1 on each rank writes its own shard. `torch.distributed.checkpoint`
checks that the boxes tile every tensor exactly and writes them in parallel.

Reading: a rank asks for the full tensor of every parameter it holds (the checkpoint reader
assembles it from whichever boxes overlap) and keeps its slice: its tp shard, then its ZeRO
pieces (the engine's `load_state_dict`). A rank therefore briefly holds the full fp32 state
of its own pipeline stage's parameters, one stage at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.checkpoint.boxes import Box, range_boxes, to_global
from plait.comm import Comm
from plait.mesh import Mesh
from plait.models.contract import ShardSpec, contract_of
from plait.parallel.grads import SplitGradRules
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.torch_private import sharded_tensor


def owned_boxes(
    engine: OptimizerEngine, model: nn.Module, rules: SplitGradRules, mesh: Mesh
) -> dict[str, list[tuple[Box, Tensor]]]:
    """`"<state>/<name>"` -> the (global box, data) this rank writes."""
    if engine.replicated and (mesh.coord.dp, mesh.coord.cp) != (0, 0):  # one copy writes
        return {}
    contract, params = contract_of(model), engine.named_parameters()
    specs = contract.shards()
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
                key = f"{state}/{contract.canonical(piece.name)}"
                out.setdefault(key, []).append((placed, data))
    return out


def global_shapes(engine: OptimizerEngine, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Single-process name -> single-process shape, for every parameter this rank holds."""
    contract = contract_of(model)
    return {contract.canonical(n): contract.entry(n).decl.shape for n in engine.named_parameters()}


def sharded_state(
    boxes: dict[str, list[tuple[Box, Tensor]]], shapes: dict[str, tuple[int, ...]], comm: Comm
) -> dict[str, Tensor]:
    """The boxes as sharded tensors, each with every rank's boxes (one gather of the box
    lists); the checkpoint planner checks that they tile each tensor exactly. A single
    process owns every box and writes plain tensors (no process group to shard over).
    The sharded tensor type is torch's private ShardedTensor (`torch_private.sharded_tensor`
    says why, and what would replace it)."""
    mesh = comm.mesh
    if mesh.world_size == 1:
        return {key: _whole(parts, shapes[key.split("/", 1)[1]]) for key, parts in boxes.items()}
    mine = {key: [(box, str(data.device)) for box, data in parts] for key, parts in boxes.items()}
    everyone = comm.all_gather_object(mine, "world", tag="checkpoint-plan")
    out = {}
    for key, parts in boxes.items():
        local = [(box.offsets, box.sizes, data) for box, data in parts]
        every = [
            (box.offsets, box.sizes, rank, device)
            for rank, theirs in enumerate(everyone)
            for box, device in theirs.get(key, [])
        ]
        out[key] = sharded_tensor(local, every, shapes[key.split("/", 1)[1]], mesh.rank)
    return out


def _whole(parts: list[tuple[Box, Tensor]], shape: tuple[int, ...]) -> Tensor:
    full = torch.empty(shape, dtype=parts[0][1].dtype)
    for box, data in parts:
        full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))] = data
    return full


def full_request(engine: OptimizerEngine, model: nn.Module, saved: set[str]) -> dict[str, Tensor]:
    """Empty full fp32 tensors for every state of every parameter this rank holds, of those
    the checkpoint has (`saved`: its keys); what it lacks is the engine's to default."""
    request = {
        f"{state}/{name}": torch.empty(shape, dtype=torch.float32)
        for name, shape in global_shapes(engine, model).items()
        for state in engine.saved_states
    }
    return {key: value for key, value in request.items() if key in saved}


def local_states(
    loaded: dict[str, Tensor], engine: OptimizerEngine, model: nn.Module
) -> dict[str, dict[str, Tensor]]:
    """This rank's name -> state -> its tp slice (padding zero), for `load_state_dict`."""
    contract = contract_of(model)
    out: dict[str, dict[str, Tensor]] = {}
    for name in engine.named_parameters():
        key, spec = contract.canonical(name), contract.entry(name).decl.shard
        out[name] = {
            state: _slice(loaded[f"{state}/{key}"], spec)
            for state in engine.saved_states
            if f"{state}/{key}" in loaded
        }
    return out


def _slice(full: Tensor, spec: ShardSpec | None) -> Tensor:
    if spec is None:
        return full
    local = torch.zeros(spec.shape, dtype=full.dtype)
    spec.unpadded(local).copy_(full[spec.region()])
    return local
