"""Host memory of one node, predicted, against what the host has (issue 23, item 8).

Activation offload and ZeRO's CPU offload put bytes in host memory, and every rank on a node
puts its own there: a run that needs more than the host has would be killed by the kernel's
out-of-memory killer part-way through a step, long after it started. The estimate's host
total per rank (saved activations, host-held master weights and moments, NVMe staging) times
the ranks of each stage on this node is compared with the host's available memory before any
worker starts. Pure: the available figure is passed in (`plait.device.host_available_bytes`
reads it), so the refusal can be tested without processes.
"""

from __future__ import annotations

from collections.abc import Iterable

from plait.config import Config
from plait.errors import ConfigError
from plait.estimate.core import estimate
from plait.estimate.lines import Estimate
from plait.topology import Layout


def node_host_bytes(est: Estimate, layout: Layout, node_ranks: Iterable[int]) -> int:
    """Host bytes the ranks `node_ranks` hold together: each its stage's host total."""
    return sum(est.ranks[layout.coord(r).pp].total("host") for r in node_ranks)


def _what(est: Estimate) -> str:
    """Which terms hold the host bytes, for the refusal's reader."""
    names = {line.name for r in est.ranks for line in r.lines if line.host}
    parts = ["saved activations (--offload-activations cpu)"] if "activations" in names else []
    if names - {"activations"}:
        parts.append("optimizer states (--offload cpu/nvme)")
    return " and ".join(parts)


def check_host_memory(est: Estimate, layout: Layout, node_ranks: range, available: int) -> None:
    """ConfigError naming both figures when the node's ranks need more host memory than
    `available` bytes."""
    need = node_host_bytes(est, layout, node_ranks)
    if need > available:
        n = len(node_ranks)
        raise ConfigError(
            f"host memory: the {n} rank{'s' if n != 1 else ''} on this node would hold "
            f"{need / 2**30:,.2f} GiB ({need:,} B) of {_what(est)} in host memory, more than "
            f"the {available / 2**30:,.2f} GiB ({available:,} B) this host has available "
            f"(plait estimate shows the terms); offload less, use fewer ranks per node or "
            f"smaller micro-batches"
        )


def holds_host_memory(cfg: Config) -> bool:
    """Whether the run puts anything in host memory (the estimator models dp_mode ddp only;
    naive dp refuses every offload anyway)."""
    par = cfg.parallel
    return par.dp_mode == "ddp" and (
        cfg.memory.offload_activations != "none" or cfg.memory.offload != "none"
    )


def check_run_host_memory(cfg: Config, node_ranks: range, available: int) -> None:
    """`check_host_memory` for a validated run config, estimated here; nothing to check for
    a run that holds nothing on the host."""
    if holds_host_memory(cfg):
        check_host_memory(estimate(cfg), cfg.parallel.layout, node_ranks, available)
