"""Per-rank memory by category and place, with per-step peaks: what a run measures.

Whoever allocates a buffer tells the tracker (`track`) and again when it frees it
(`release`); the tracker keeps the current bytes of every (category, place) and the peak
since `begin_step`. Bytes come from the tensors themselves (storage size, padding
included), so they measure what was allocated, not what should have been. On CUDA the
report adds the caching allocator's own peak (from `plait.device`), which also sees what
nobody registered (workspaces, fragmentation); on CPU there is no such allocator to ask.

Categories (ZeRO's *model states* are the first four):
  parameters, gradients, optimizer_states (Adam moments), master_weights (fp32 copies),
  activations (tensors saved for backward, while autograd holds them), comm_buffers
  (transient reduction buckets).
Places: device (the accelerator, or the CPU when that is the device), host (offloaded to
CPU memory), disk (offloaded to NVMe files).

What a run *should* hold is predicted by `plait.estimate` (the formulas live there); the
tests compare the two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from plait.device import peak_allocated_bytes, reset_peak
from plait.torch_private import view_base

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_states",
    "master_weights",
    "activations",
    "comm_buffers",
)
MODEL_STATES = CATEGORIES[:4]
PLACES = ("device", "host", "disk")


@dataclass
class _Allocation:
    category: str
    place: str
    nbytes: int
    transient: bool


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind `t` (0 for a storage resized away, as stage 3 does)."""
    return t.untyped_storage().nbytes()


class MemoryTracker:
    """Current and peak bytes per category and place on this rank."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._allocs: dict[str, _Allocation] = {}
        self._current: dict[tuple[str, str], int] = {}
        self._peak: dict[tuple[str, str], int] = {}
        self._peak_total: dict[str, int] = {}

    # -- registration ------------------------------------------------------------------
    def track(
        self,
        key: str,
        category: str,
        size: torch.Tensor | int,
        place: str = "device",
        transient: bool = False,
    ) -> None:
        """Record (or resize) allocation `key`; `size` is bytes or a tensor to measure."""
        if category not in CATEGORIES or place not in PLACES:
            raise ValueError(
                f"unknown memory category {category!r} or place {place!r}; "
                f"categories {CATEGORIES}, places {PLACES}"
            )
        nbytes = tensor_bytes(size) if isinstance(size, torch.Tensor) else int(size)
        self.release(key)
        self._allocs[key] = _Allocation(category, place, nbytes, transient)
        self._add(category, place, nbytes)

    def release(self, key: str) -> None:
        """Forget allocation `key` (a no-op when it is not tracked)."""
        alloc = self._allocs.pop(key, None)
        if alloc is not None:
            self._add(alloc.category, alloc.place, -alloc.nbytes)

    def _add(self, category: str, place: str, delta: int) -> None:
        key = (category, place)
        self._current[key] = self._current.get(key, 0) + delta
        self._peak[key] = max(self._peak.get(key, 0), self._current[key])
        total = sum(v for (_, p), v in self._current.items() if p == place)
        self._peak_total[place] = max(self._peak_total.get(place, 0), total)

    # -- queries -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a new peak window at the current figures (and the allocator's, on CUDA)."""
        self._peak = dict(self._current)
        for place in PLACES:
            self._peak_total[place] = self.current(place=place)
        reset_peak(self.device)

    def current(self, category: str | None = None, place: str = "device") -> int:
        return sum(v for (c, p), v in self._current.items() if p == place and category in (None, c))

    def peak(self, category: str | None = None, place: str = "device") -> int:
        """Peak of one category, or (category None) of the sum of all, since begin_step."""
        if category is None:
            return self._peak_total.get(place, 0)
        return self._peak.get((category, place), 0)

    def model_state_bytes(self, place: str = "device") -> int:
        """Persistent parameters, gradients, master weights and moments (ZeRO's model states)."""
        return sum(
            a.nbytes
            for a in self._allocs.values()
            if a.category in MODEL_STATES and a.place == place and not a.transient
        )

    def persistent(self, category: str, place: str = "device") -> int:
        return sum(
            a.nbytes
            for a in self._allocs.values()
            if a.category == category and a.place == place and not a.transient
        )

    def report(self) -> dict:
        """Everything, as plain numbers for metrics.jsonl and the run summary."""
        out: dict = {"model_states": {}, "current": {}, "peak": {}, "peak_total": {}}
        for place in PLACES:
            out["model_states"][place] = self.model_state_bytes(place)
            out["peak_total"][place] = self.peak(place=place)
            out["current"][place] = {c: self.current(c, place) for c in CATEGORIES}
            out["peak"][place] = {c: self.peak(c, place) for c in CATEGORIES}
        out["allocator_peak"] = peak_allocated_bytes(self.device)
        return out

    # -- activations -------------------------------------------------------------------
    @contextmanager
    def activations(self, key: str = "activations") -> Iterator[None]:
        """Count the bytes autograd saves for backward inside the block (wrap one step, or
        the forward and backward of one micro-batch): a tensor counts from the forward that
        saves it until autograd drops it (after its node's backward), so `peak` is the most
        ever held at once, e.g. the micro-batches a pipeline schedule keeps in flight.

        Parameters and views of them (a Linear saves `weight.t()`), frozen ones included (a
        LoRA adapter's input gradient needs the frozen base weight), are not activations and
        are skipped, and so are other leaves that require grad (a pipeline stage's received
        input: a receive buffer, not something this stage's forward made). Each storage
        counts once, however many views of it are saved. Whatever activation recomputation
        saves is what counts. A tensor that activation offload moved to host memory
        (`mark_offloaded`) counts in place host for as long as autograd holds its host copy.
        """
        held: dict[int, list] = {}  # storage pointer -> [references, bytes, place]
        live = {"device": 0, "host": 0}

        def meter(place: str) -> None:
            name = key if place == "device" else f"{key}:{place}"
            self.track(name, "activations", live[place], place=place, transient=True)

        def drop(ptr: int) -> None:
            entry = held.get(ptr)
            if entry is None:  # the block ended first: already released
                return
            entry[0] -= 1
            if entry[0] == 0:
                del held[ptr]
                live[entry[2]] -= entry[1]
                meter(entry[2])

        def pack(t: torch.Tensor) -> torch.Tensor | _Saved:
            base = view_base(t)  # a view's base (Tensor._base: torch_private says why)
            if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
                return t
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            place = "host" if is_offloaded(t) else "device"
            entry = held.setdefault(ptr, [0, storage.nbytes(), place])
            if entry[0] == 0:
                live[place] += entry[1]
                meter(place)
            entry[0] += 1
            # detached: an output saved by the node that made it would otherwise hold that
            # node through its grad_fn, a cycle through C++ that Python's collector cannot
            # break; a graph kept past its backward (ZB-H1's split B/W) then never frees.
            # Autograd restores the grad_fn on unpack (torch's saved_tensors_hooks warning).
            return _Saved(t.detach(), ptr, drop)

        def unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
            return saved.tensor if isinstance(saved, _Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            try:
                yield
            finally:
                held.clear()
                self.release(key)
                self.release(f"{key}:host")


_OFFLOADED = "_plait_offloaded"


def mark_offloaded(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as a host copy made by activation offload, so the meter counts it in place
    host (on a CPU run host and device are the same memory and only the mark tells them
    apart)."""
    setattr(t, _OFFLOADED, True)
    return t


def is_offloaded(t: torch.Tensor) -> bool:
    return bool(getattr(t, _OFFLOADED, False))


class _Saved:
    """A saved tensor as autograd holds it: when autograd drops it, the meter is told."""

    __slots__ = ("_drop", "_ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, ptr: int, drop) -> None:
        self.tensor, self._ptr, self._drop = tensor, ptr, drop

    def __del__(self) -> None:
        self._drop(self._ptr)
