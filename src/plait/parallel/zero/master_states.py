"""Where the fp32 master weights and the optimizer moments live: device, host (ZeRO-Offload)
or NVMe files (ZeRO-Infinity), behind one interface.

The engine walks `chunks()`: each yields one slice of one group's shard with its master
weights and moments as fp32 tensors in memory, which the optimizer updates in place. A
resident store yields whole shards; the NVMe store yields *sub-groups*, reading each from
its file into one reusable staging buffer and writing it back when the optimizer is done,
so the optimizer-state memory resident at any time is one sub-group, whatever the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from plait.device import host_empty as device_host_empty
from plait.memory_tracker import MemoryTracker


@dataclass
class Chunk:
    """A slice [start, end) of group `group`'s shard and its states, in memory."""

    group: int
    start: int
    end: int
    tensors: dict[str, Tensor]  # "master" and the optimizer's states; fp32, end - start


def host_empty(numel: int, device: torch.device) -> Tensor:
    """fp32 host memory, pinned when the compute device is a GPU (asynchronous copies need
    page-locked memory; on a CPU-only build pinning is unavailable and pointless)."""
    return device_host_empty(numel, torch.float32, device)


class ResidentStates:
    """States in memory: on the device (offload 'none') or the host (offload 'cpu').

    `masters[i]` is the initial fp32 shard of group i; `names` are the optimizer's states
    (zero-initialized). With `alias` the master *is* that tensor (fp32 training without
    offload: the parameter shard is the master weight, so no copy exists).
    """

    def __init__(
        self,
        masters: list[Tensor],
        names: tuple[str, ...],
        offload: str,
        device: torch.device,
        alias: bool,
        tracker: MemoryTracker,
    ) -> None:
        self.place = "host" if offload == "cpu" else "device"
        self.device = torch.device("cpu") if offload == "cpu" else device
        self.names = ("master", *names)
        self.alias = alias
        self.states: list[dict[str, Tensor]] = []
        for i, m in enumerate(masters):
            if alias:
                master = m
            else:
                master = host_empty(m.numel(), device) if offload == "cpu" else torch.empty_like(m)
                master.copy_(m)
                tracker.track(f"master:{i}", "master_weights", master, self.place)
            tensors = {"master": master}
            for name in names:
                tensors[name] = torch.zeros(m.numel(), dtype=torch.float32, device=self.device)
                tracker.track(f"{name}:{i}", "optimizer_states", tensors[name], self.place)
            self.states.append(tensors)

    def rebind(self, masters: list[Tensor]) -> None:
        """Alias the masters to other tensors of the same sizes: 2BW updates whichever of its
        two weight copies is free while the moments carry over (`parallel/whole_adamw.py`)."""
        if not self.alias:
            raise RuntimeError("only aliased masters can be rebound; these are copies")
        for i, (tensors, master) in enumerate(zip(self.states, masters, strict=True)):
            if master.numel() != tensors["master"].numel():
                raise ValueError(
                    f"master {i}: {master.numel()} elements, not {tensors['master'].numel()}"
                )
            tensors["master"] = master

    def chunks(self) -> Iterator[Chunk]:
        for i, tensors in enumerate(self.states):
            yield Chunk(i, 0, tensors["master"].numel(), tensors)

    def read(self, group: int, start: int, end: int) -> dict[str, Tensor]:
        return {k: v[start:end].clone() for k, v in self.states[group].items()}

    def write(self, group: int, start: int, values: dict[str, Tensor]) -> None:
        for k, v in values.items():
            self.states[group][k][start : start + v.numel()].copy_(v)

    def close(self) -> None:
        pass
