"""Every call into the device's runtime lives here, so the rest of plait runs unchanged on CPU
and CUDA.

Core code asks this module for the device, the backend and memory figures; it never calls
torch.cuda itself (that breaks CPU runs and hides device assumptions; tests/test_layering.py
checks). A choice a rule makes by the device's type stays with its rule: `comm.py` waits for
a CPU collective under its own deadline where NCCL's stream waits, `models/packed_attention.py`
picks an attention path, `config.py` refuses a CUDA device torch does not see.
"""

from __future__ import annotations

import os

import torch

from plait.errors import ConfigError


def device_kind(kind: str) -> str:
    """'auto' is CUDA when present, else CPU; 'cpu' and 'cuda' are themselves."""
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def resolve_device(kind: str, local_rank: int) -> torch.device:
    """'auto' picks CUDA when present (one GPU per local rank), else CPU."""
    kind = device_kind(kind)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device(kind)


def cuda_available() -> bool:
    """Whether a CUDA device can be used (for checks before any worker starts)."""
    return torch.cuda.is_available()


def check_gpu_per_rank(kind: str, local_ranks: int) -> None:
    """CUDA ranks each need a GPU of their own: NCCL refuses two ranks on one device
    ("Duplicate GPU detected") in every worker, at their first collective."""
    if device_kind(kind) != "cuda":
        return
    count = torch.cuda.device_count()
    if local_ranks > count:
        raise ConfigError(
            f"{local_ranks} ranks on this machine need {local_ranks} CUDA devices, one each "
            f"(NCCL), but torch sees {count}; run fewer ranks (dp x tp x pp) or --device cpu"
        )


def backend_for(device: torch.device) -> str:
    """NCCL for GPUs, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The allocator's peak since the last reset, where the device has an allocator to ask."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of well-known GPUs, for MFU; None where unknown (give --peak-flops)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}
    return next((v for k, v in table.items() if k in name), None)


def threads_per_worker(local_world: int) -> int:
    """Split the host's cores between the local workers so they don't oversubscribe."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world))


def host_available_bytes() -> int:
    """Host memory a new run can still take: the kernel's MemAvailable (free memory plus
    the page cache and reclaimable slabs it would give back, without swapping), from
    /proc/meminfo; where there is none (not Linux), the free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the figure is in KiB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for offloaded state: pinned when the compute device is a GPU, because
    asynchronous copies need page-locked memory (on a CPU-only build pinning is unavailable
    and pointless)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


class HostCopies:
    """How a saved activation goes to host memory and back (activation offload), on the
    device the run computes on.

    On a GPU the copy to the host runs on a side stream, so the forward's kernels, queued on
    the compute stream, overlap it. The side stream first waits for the compute stream (the
    tensor must be computed before it is read); the device tensor is marked used by the side
    stream (`record_stream`: the forward drops it as soon as it is copied out, and the caching
    allocator must not hand its memory to a later kernel's output before the copy has read
    it); an event recorded after the copy is what the copy back waits on. The copy back runs
    on the compute stream after that event, so the backward kernels queued behind it on the
    same stream read it whole. The pinned host buffers are the caching host allocator's, which
    keeps each until the copies queued on it have run. On the CPU both are plain copies (still
    a separate tensor, so host bytes can be counted) and there is no event. The GPU path ran
    on an H200, bitwise equal to no offload in torch's deterministic mode (docs/memory.md).
    """

    def __init__(self, device: torch.device) -> None:
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """A host copy of `t` (strides kept) and what a copy back must wait for (None: nothing)."""
        if self._side is None or t.device.type != "cuda":
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
            return host, None
        self._side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._side):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        t.record_stream(self._side)
        return host, done

    def from_host(
        self, host: torch.Tensor, done: object | None, device: torch.device
    ) -> torch.Tensor:
        """The copy of an offloaded activation on `device` for backward, after the copy to
        the host (`done`) has finished (strides kept: backward sees the layout forward saved)."""
        out = torch.empty_like(host, device=device)
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
        out.copy_(host, non_blocking=device.type == "cuda")
        return out
