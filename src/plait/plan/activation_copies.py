"""What activation offload costs a plan: the saved tensors' copies to the host and back.

With `--offload-activations cpu` each micro-batch's saved block tensors on a chunk (the
estimator's host bytes per micro-batch, `chunk_activation_places`) cross the host link twice,
at the profile's `host_bandwidth`: down during the forward, up before the backward needs
them. The copy down runs on a side stream (`device.HostCopies`), so up to the profile's
`overlap` of it hides behind the chunk's forward compute; the copy back is queued on the
compute stream ahead of the backward kernels that read it, and is exposed whole. On a CPU
profile (overlap 0) both are exposed, as they are: the copies run on the cores.

The host holds each node's ranks' host totals at once (the blocks' saved tensors, and an
offloaded optimizer's states): a profile that names its `host_memory` per node bounds it.
"""

from __future__ import annotations

from plait.config import Config
from plait.estimate.core import chunk_activation_places
from plait.estimate.host import node_host_bytes
from plait.estimate.lines import Estimate
from plait.plan.hardware import Hardware
from plait.schedule.stages import StagePlan


def copy_seconds(
    cfg: Config, hw: Hardware, plan: StagePlan, forward_s: float
) -> tuple[float, float]:
    """(exposed seconds in F, in B) of one micro-batch's copies on `plan`'s chunk, whose
    forward computes for `forward_s` seconds."""
    if cfg.memory.offload_activations == "none":
        return 0.0, 0.0
    moved = chunk_activation_places(cfg, plan)[1] / hw.host_bandwidth
    return moved - hw.overlap * min(moved, forward_s), moved


def most_host_per_node(est: Estimate, cfg: Config, gpus_per_node: int) -> int:
    """The host bytes of the busiest node: ranks are numbered node by node."""
    layout = cfg.parallel.layout
    world, per = layout.world_size, max(1, gpus_per_node)
    return max(
        node_host_bytes(est, layout, range(first, min(first + per, world)))
        for first in range(0, world, per)
    )


def host_fits(est: Estimate, cfg: Config, hw: Hardware, gpus_per_node: int) -> bool:
    """Whether every node's host holds its ranks' host bytes (unbounded where the profile
    names no `host_memory`)."""
    return not hw.host_memory or most_host_per_node(est, cfg, gpus_per_node) <= hw.host_memory
