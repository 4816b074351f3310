"""NVMe offload (ZeRO-Infinity, Rajbhandari et al., 2021): optimizer states in files.

Each rank keeps its fp32 master weights and optimizer states (Adam: two moments) in one
file, DIR/plait-zero-rank{R}.bin, laid out sub-group after sub-group, each as
[master | exp_avg | exp_avg_sq]. The optimizer step streams the sub-groups through one
staging buffer of `sub_group` fp32 elements per state: read, update, write back. Resident
optimizer-state memory is therefore bounded by one sub-group, however large the model;
the cost (Adam) is reading and writing 12 bytes per parameter shard element every step.

Reads and writes are plain positioned I/O (pread/pwrite) into the staging tensors'
memory, with no copy in between. The page cache may still hold the file (the kernel's
choice, and reclaimable); O_DIRECT and read-ahead of the next sub-group are not done.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from plait.errors import ConfigError
from plait.memory_tracker import MemoryTracker
from plait.parallel.zero.master_states import Chunk

_F32 = 4


def _buffer(t: Tensor) -> memoryview:
    """The bytes of a contiguous fp32 CPU tensor, writable, without a copy."""
    return memoryview(t.numpy()).cast("B")


class NvmeStates:
    """Master weights and moments of every group shard in one file, streamed by sub-group."""

    def __init__(
        self,
        masters: list[Tensor],
        names: tuple[str, ...],
        directory: str | Path,
        rank: int,
        sub_group: int,
        tracker: MemoryTracker,
    ) -> None:
        if sub_group < 1:
            raise ConfigError(f"NVMe offload sub-group must hold >= 1 element, got {sub_group}")
        folder = Path(directory)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create offload directory {str(folder)!r}: {e}") from e
        self.path = folder / f"plait-zero-rank{rank}.bin"
        self.names = ("master", *names)
        self.place = "host"
        self.device = torch.device("cpu")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # (group, start, end, file offset) per sub-group; a sub-group never spans groups.
        self.layout: list[tuple[int, int, int, int]] = []
        offset = 0
        for i, m in enumerate(masters):
            for start in range(0, m.numel(), sub_group):
                end = min(start + sub_group, m.numel())
                self.layout.append((i, start, end, offset))
                offset += len(self.names) * (end - start) * _F32
        self.staging = {n: torch.zeros(sub_group, dtype=torch.float32) for n in self.names}
        tracker.track("nvme:staging:master", "master_weights", self.staging["master"], "host")
        for n in names:
            tracker.track(f"nvme:staging:{n}", "optimizer_states", self.staging[n], "host")
        per_state = offset // len(self.names)
        tracker.track("nvme:file:master", "master_weights", per_state, "disk")
        tracker.track("nvme:file:states", "optimizer_states", offset - per_state, "disk")
        self._initialize(masters)

    def _initialize(self, masters: list[Tensor]) -> None:
        for group, start, end, offset in self.layout:
            n = end - start
            self.staging["master"][:n].copy_(masters[group][start:end])
            for name in self.names[1:]:
                self.staging[name][:n].zero_()
            self._io(os.pwritev, n, offset)

    def _io(self, op, n: int, offset: int) -> None:
        """Read or write one sub-group of n elements between the file and the staging."""
        views = [_buffer(self.staging[name][:n]) for name in self.names]
        done = op(self._fd, views, offset)
        if done != len(self.names) * n * _F32:
            raise OSError(f"short {op.__name__} on {self.path}: {done} bytes at offset {offset}")

    def chunks(self) -> Iterator[Chunk]:
        for group, start, end, offset in self.layout:
            n = end - start
            self._io(os.preadv, n, offset)
            yield Chunk(group, start, end, {k: v[:n] for k, v in self.staging.items()})
            self._io(os.pwritev, n, offset)

    def _overlapping(self, group: int, start: int, end: int):
        for g, a, b, offset in self.layout:
            if g == group and a < end and start < b:
                yield a, b, offset

    def read(self, group: int, start: int, end: int) -> dict[str, Tensor]:
        out = {k: torch.empty(end - start, dtype=torch.float32) for k in self.names}
        for a, b, offset in self._overlapping(group, start, end):
            self._io(os.preadv, b - a, offset)
            lo, hi = max(a, start), min(b, end)
            for k in self.names:
                out[k][lo - start : hi - start].copy_(self.staging[k][lo - a : hi - a])
        return out

    def write(self, group: int, start: int, values: dict[str, Tensor]) -> None:
        end = start + next(iter(values.values())).numel()
        for a, b, offset in self._overlapping(group, start, end):
            self._io(os.preadv, b - a, offset)
            lo, hi = max(a, start), min(b, end)
            for k, v in values.items():
                self.staging[k][lo - a : hi - a].copy_(v[lo - start : hi - start])
            self._io(os.pwritev, b - a, offset)

    def close(self) -> None:
        """Close and delete the file (its contents are this run's transient states)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)
