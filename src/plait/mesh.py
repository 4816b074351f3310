"""Process groups per parallel axis, built once and passed explicitly to whoever communicates.

A Mesh is plain data: the layout, this rank's coordinates, its device, one process group per
axis of size > 1 (an axis of size 1 has no group: nothing to communicate), and the key-value
store the world was started with, when the caller kept it. No module-level state: two meshes
can coexist (tests build several in one world).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.topology import AXES, Coord, Layout


@dataclass
class Mesh:
    """This rank's view of the parallel layout."""

    layout: Layout
    rank: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    timeout_s: float = 300.0
    store: dist.Store | None = None
    """The store the default process group was initialised with (`launch.init_worker` keeps
    it): `Comm.agreed_stop` agrees on a stop through it without a collective. None where the
    world was joined without handing one over (the test harness, benchmarks)."""

    @property
    def coord(self) -> Coord:
        return self.layout.coord(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def size(self, axis: str) -> int:
        if axis == "world":
            return self.layout.world_size
        if axis in AXES:
            return self.layout.size(axis)
        return len(self.group_ranks.get(axis, [self.rank]))

    def axis_rank(self, axis: str) -> int:
        if axis == "world":
            return self.rank
        if axis in AXES:
            return self.coord.get(axis)
        return self.group_ranks[axis].index(self.rank)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of `axis` ('world' for all ranks); None when it has one rank."""
        if axis == "world":
            return dist.group.WORLD if self.world_size > 1 else None
        return self.groups[axis]

    def ranks(self, axis: str) -> list[int]:
        if axis == "world":
            return list(range(self.world_size))
        return self.group_ranks[axis]

    @property
    def replicas_axis(self) -> str:
        """The axis whose ranks hold other tokens of one model: 'dp', or 'dpcp' (dp x cp)
        under context parallelism, where gradients are reduced and ZeRO shards."""
        return "dpcp" if self.layout.cp > 1 else "dp"

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 prints progress and writes files."""
        return self.rank == 0


def single_process_mesh(device: torch.device | None = None) -> Mesh:
    """A world of one: no process group needed (the single-process reference)."""
    layout = Layout()
    return Mesh(
        layout=layout,
        rank=0,
        device=device or torch.device("cpu"),
        groups={a: None for a in AXES},
        group_ranks={a: [0] for a in AXES},
    )


def build_mesh(
    layout: Layout, device: torch.device, timeout_s: float = 300.0, store: dist.Store | None = None
) -> Mesh:
    """Create the groups of every axis; all ranks must call this together, in the same order.
    `store`: the one `dist.init_process_group` was given, kept for `Mesh.store`."""
    if layout.world_size == 1 and not dist.is_initialized():
        mesh = single_process_mesh(device)
        mesh.timeout_s = timeout_s
        return mesh
    layout.check_world(dist.get_world_size())
    rank = dist.get_rank()
    groups: dict[str, dist.ProcessGroup | None] = {}
    group_ranks: dict[str, list[int]] = {}
    timeout = datetime.timedelta(seconds=timeout_s)
    for axis in AXES:
        group_ranks[axis] = layout.axis_ranks(axis, rank)
        if layout.size(axis) == 1:
            groups[axis] = None
            continue
        mine = None
        for ranks in layout.axis_groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        groups[axis] = mine
    _add_pipeline_ends(layout, rank, timeout, groups, group_ranks)
    _add_replicas(layout, rank, timeout, groups, group_ranks)
    return Mesh(layout, rank, device, groups, group_ranks, timeout_s, store)


def _add_pipeline_ends(layout: Layout, rank: int, timeout, groups: dict, group_ranks: dict) -> None:
    """'pp_ends': first and last pipeline stage of each (dp, tp) position.

    Tied input/output embeddings live on both ends of the pipeline; their gradients are summed
    over this group (Megatron's embedding group). Middle stages are in no such group.
    """
    if layout.pp == 1:
        return
    for ranks in layout.axis_groups("pp"):
        ends = [ranks[0], ranks[-1]]
        group = dist.new_group(ends, timeout=timeout)
        if rank in ends:
            groups["pp_ends"], group_ranks["pp_ends"] = group, ends


def _add_replicas(layout: Layout, rank: int, timeout, groups: dict, group_ranks: dict) -> None:
    """'dpcp': the ranks that differ only along dp and cp (`Mesh.replicas_axis` under context
    parallelism), each holding other tokens of the same model part."""
    if layout.cp == 1:
        return
    made: set[tuple[int, ...]] = set()
    for r in range(layout.world_size):  # every group, in the same order on every rank
        ranks = tuple(layout.replica_ranks(r))
        if ranks in made:
            continue
        made.add(ranks)
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            groups["dpcp"], group_ranks["dpcp"] = group, list(ranks)
