"""Hardware profiles: what a device computes and how fast its links move bytes (pure).

A profile is a TOML file (`plait/plan/hardware/*.toml` ship H100, A100 and this-CPU figures;
`plait calibrate` writes one measured here). Communication follows the alpha-beta model of
a ring collective over n ranks: time = steps(op, n)·alpha + bytes·factor(op, n)/beta, with

  all_reduce:                   2(n-1) steps, factor 2(n-1)/n
  all_gather, reduce_scatter:   n-1 steps,    factor (n-1)/n
  p2p (one send):               1 step,       factor 1

where `bytes` are plait's *logical* bytes (comm.py's convention: the full buffer), so beta is
the bus bandwidth NCCL's tests report. Each link class (`intra`: within a node, `inter`:
across nodes) has its own (alpha, beta) per op; an op the file leaves out uses all_reduce's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from plait.errors import ConfigError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
LINKS = ("intra", "inter")
SHIPPED = ("h100", "a100", "cpu")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int | float) -> int:
    """'80GiB', '80 GB', 85899345920 -> bytes; ConfigError naming the text otherwise."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return int(text)
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = found.group(2).upper() if found else ""
    if not found or unit not in _UNITS:
        raise ConfigError(f"memory size {text!r} is not a number with a unit like 80GiB or 40GB")
    size = int(float(found.group(1)) * _UNITS[unit])
    if size <= 0:  # else the planner reports that nothing fits in "-"
        raise ConfigError(f"memory size {text!r} must be more than 0 bytes")
    return size


@dataclass(frozen=True)
class OpCost:
    """One op on one link class: seconds per ring step, logical bytes per second."""

    alpha_s: float
    beta_bytes_per_s: float


def ring_steps_and_factor(op: str, n: int) -> tuple[int, float]:
    """(latency steps, bandwidth factor) of a ring `op` over n ranks (module doc)."""
    if op == "p2p":
        return 1, 1.0
    if n <= 1:
        return 0, 0.0
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    raise ConfigError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


@dataclass(frozen=True)
class Link:
    """A link class: (alpha, beta) per op."""

    ops: dict[str, OpCost]

    @cached_property
    def key(self) -> tuple[tuple[str, OpCost], ...]:
        """The costs as a hashable key (a planner keeps traffic per link)."""
        return tuple(sorted(self.ops.items()))

    def cost(self, op: str) -> OpCost:
        return self.ops.get(op) or self.ops["all_reduce"]

    def time(self, op: str, n: int, nbytes: float, calls: int = 1) -> float:
        """Seconds for `calls` calls of `op` over n ranks moving `nbytes` logical bytes in all."""
        steps, factor = ring_steps_and_factor(op, n)
        if steps == 0 or calls == 0:
            return 0.0
        c = self.cost(op)
        return calls * steps * c.alpha_s + nbytes * factor / c.beta_bytes_per_s


@dataclass(frozen=True)
class Hardware:
    """One device type and its links (see the module doc and docs/planning.md)."""

    name: str
    peak_flops: float  # dense FLOP/s per device at `precision`
    achievable: float  # fraction of peak a transformer's matmuls reach
    memory: int  # bytes per device
    host_bandwidth: float  # bytes/s device <-> host (offload cpu)
    disk_bandwidth: float  # bytes/s host <-> NVMe (offload nvme)
    intra: Link
    inter: Link
    precision: str = "bf16"  # the compute dtype the peak is for (the plan's precision)
    overlap: float = 1.0  # share of overlappable communication that hides behind compute
    pass_overhead_s: float = 0.0  # fixed seconds per block (or head) per F, B or W pass
    contention: float = 1.0  # ranks sharing one compute unit when all are busy (CPU: > 1)
    optimizer_s_per_element: float = 0.0  # norm, clip, AdamW, zero_grad per shard element
    action_overhead_s: float = 0.0  # the pipeline runtime's own seconds per compute action
    host_memory: int = 0  # bytes of host memory per node (0: not bounded)
    host_is_device: bool = False  # a CPU: offloading activations moves them within one memory
    note: str = ""

    @property
    def flop_rate(self) -> float:
        return self.peak_flops * self.achievable

    def link(self, span: int, gpus_per_node: int) -> Link:
        """The link class of an axis whose groups span `span` consecutive ranks."""
        return self.intra if span <= gpus_per_node else self.inter


def _link(raw: dict[str, Any], where: str) -> Link:
    if "all_reduce" not in raw:
        raise ConfigError(f"hardware file: [{where}] needs an [{where}.all_reduce] table")
    ops = {}
    for op, v in raw.items():
        if op not in OPS:
            raise ConfigError(f"hardware file: unknown op [{where}.{op}]; known: {', '.join(OPS)}")
        ops[op] = OpCost(float(v["alpha_s"]), float(v["beta_bytes_per_s"]))
        if ops[op].beta_bytes_per_s <= 0 or ops[op].alpha_s < 0:
            raise ConfigError(f"hardware file: [{where}.{op}] needs alpha_s >= 0, beta > 0")
    return Link(ops)


def from_dict(raw: dict[str, Any]) -> Hardware:
    """A Hardware from the TOML's tables (ConfigError naming what is missing)."""
    need = ("name", "peak_flops", "achievable", "memory", "host_bandwidth", "disk_bandwidth")
    missing = [k for k in (*need, *LINKS) if k not in raw]
    if missing:
        raise ConfigError(f"hardware file is missing {', '.join(missing)}")
    return Hardware(
        name=str(raw["name"]),
        peak_flops=float(raw["peak_flops"]),
        achievable=float(raw["achievable"]),
        memory=parse_size(raw["memory"]),
        host_bandwidth=float(raw["host_bandwidth"]),
        disk_bandwidth=float(raw["disk_bandwidth"]),
        intra=_link(raw["intra"], "intra"),
        inter=_link(raw["inter"], "inter"),
        precision=str(raw.get("precision", "bf16")),
        overlap=float(raw.get("overlap", 1.0)),
        pass_overhead_s=float(raw.get("pass_overhead_s", 0.0)),
        contention=float(raw.get("contention", 1.0)),
        optimizer_s_per_element=float(raw.get("optimizer_s_per_element", 0.0)),
        action_overhead_s=float(raw.get("action_overhead_s", 0.0)),
        host_memory=parse_size(raw["host_memory"]) if "host_memory" in raw else 0,
        host_is_device=bool(raw.get("host_is_device", False)),
        note=str(raw.get("note", "")),
    )


def to_dict(hw: Hardware) -> dict[str, Any]:
    """The TOML tables of `hw` (what `plait calibrate` writes)."""
    out: dict[str, Any] = {
        "name": hw.name,
        "precision": hw.precision,
        "peak_flops": hw.peak_flops,
        "achievable": hw.achievable,
        "memory": f"{hw.memory / 2**30:.2f}GiB",
        "host_bandwidth": hw.host_bandwidth,
        "disk_bandwidth": hw.disk_bandwidth,
        "overlap": hw.overlap,
        "pass_overhead_s": hw.pass_overhead_s,
        "contention": hw.contention,
        "optimizer_s_per_element": hw.optimizer_s_per_element,
        "action_overhead_s": hw.action_overhead_s,
    }
    if hw.host_memory:
        out["host_memory"] = hw.host_memory  # exact bytes: parse_size reads an int
    if hw.host_is_device:
        out["host_is_device"] = True
    if hw.note:
        out["note"] = hw.note
    for name in LINKS:
        link: Link = getattr(hw, name)
        out[name] = {op: vars(c).copy() for op, c in link.ops.items()}
    return out


def load_hardware(name_or_path: str) -> Hardware:
    """A shipped profile by name (h100, a100, cpu) or a TOML file's path."""
    if name_or_path in SHIPPED:
        text = resources.files("plait.plan").joinpath(f"hardware/{name_or_path}.toml").read_text()
        return from_dict(tomllib.loads(text))
    p = Path(name_or_path)
    if not p.is_file():
        raise ConfigError(
            f"hardware {name_or_path!r} is neither a shipped profile ({', '.join(SHIPPED)}) "
            "nor a file (plait calibrate --out FILE writes one)"
        )
    try:
        return from_dict(tomllib.loads(p.read_text()))
    except (tomllib.TOMLDecodeError, KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"hardware file {str(p)!r} is not a valid profile: {e}") from e


def save_hardware(hw: Hardware, path: str | Path) -> None:
    Path(path).write_text(tomli_w.dumps(to_dict(hw)))
