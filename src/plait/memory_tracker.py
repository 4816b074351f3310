"""Per-rank memory by category, with per-step peaks, next to the ZeRO paper's formulas.

Whoever allocates a buffer tells the tracker (`track`) and again when it frees it
(`release`); the tracker keeps the current bytes of every (category, place) and the peak
since `begin_step`. Bytes come from the tensors themselves (storage size, padding
included), so they measure what was allocated, not what should have been. On CUDA the
report adds the caching allocator's own peak (from `plait.device`), which also sees what
nobody registered (workspaces, fragmentation); on CPU there is no such allocator to ask.

Categories (ZeRO's *model states* are the first four):
  parameters, gradients, optimizer_states (Adam moments), master_weights (fp32 copies),
  activations (tensors saved for backward), comm_buffers (transient reduction buckets).
Places: device (the accelerator, or the CPU when that is the device), host (offloaded to
CPU memory), disk (offloaded to NVMe files).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from plait.device import peak_allocated_bytes, reset_peak

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
        """Count the bytes autograd saves for backward inside the block (wrap forward and
        backward of one micro-batch); they count as live until the block ends.

        Parameters are not activations and are skipped; each storage counts once (views of
        one activation share it). Whatever activation recomputation saves is what counts.
        """
        seen: set[int] = set()
        live = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal live
            if not (t.is_leaf and t.requires_grad):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    live += storage.nbytes()
                    self.track(key, "activations", live, transient=True)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            try:
                yield
            finally:
                self.release(key)


# ---------------------------------------------------------------- formulas


def zero_model_state_bytes(
    stage: int, psi: int, n: int, param_bytes: int, grad_bytes: int, optim_bytes: int
) -> float:
    """Per-rank model-state bytes of ZeRO `stage` (Rajbhandari et al., 2020, section 5).

    With Ψ parameters, N data-parallel ranks, P/G bytes per parameter and gradient element
    and K bytes of optimizer state per element (Adam: 8 for the moments, + 4 for fp32
    master weights under mixed precision):
      stage 0: (P+G+K)Ψ;  stage 1: (P+G)Ψ + KΨ/N;  stage 2: PΨ + (G+K)Ψ/N;  stage 3: (P+G+K)Ψ/N.
    Mixed-precision Adam (P=G=2, K=12): 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.
    """
    p, g, k = param_bytes * psi, grad_bytes * psi, optim_bytes * psi
    per_stage = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}
    if stage not in per_stage:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")
    return per_stage[stage]


def zero_comm_elements(stage: int, psi: int, accumulation: int = 1) -> dict[str, int]:
    """Logical elements per optimizer step of the gradient and parameter collectives.

    DP all-reduce Ψ; ZeRO-1/2 reduce-scatter Ψ + all-gather Ψ; ZeRO-3 all-gather 2Ψ +
    reduce-scatter Ψ (ZeRO paper, section 7). With gradient accumulation over k micro-batches,
    stages 2 and 3 keep no full gradient between micro-batches, so they reduce-scatter every
    micro-batch (kΨ), and stage 3 gathers the parameters for every forward and backward (2kΨ).
    """
    k = accumulation
    table = {
        0: {"all_reduce": psi},
        1: {"reduce_scatter": psi, "all_gather": psi},
        2: {"reduce_scatter": k * psi, "all_gather": psi},
        3: {"reduce_scatter": k * psi, "all_gather": 2 * k * psi},
    }
    if stage not in table:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")
    return table[stage]
