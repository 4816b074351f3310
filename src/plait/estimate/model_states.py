"""Model states per rank: parameters, gradients, master weights and optimizer moments.

Follows what `parallel/zero/` allocates, group by group, rather than the paper's Ψ-level
formula (`formulas.zero_model_state_bytes`, which it reduces to): the flat groups are the
engine's (byte-capped buckets for stages 0-2, one per block plus the root for stage 3, a
tied embedding copy alone), each padded to a multiple of the N data-parallel ranks from
stage 1 on, so the figures equal the memory tracker's to the byte.

Per group of n elements, padded to P, shard S = P/N (stage 0: P = S = n), with parameter,
reduction and fp32 bytes p, r and 4:
  parameters:       P·p (stages 0-2) or S·p (stage 3)
  gradients:        P·r (stages 0-1) or S·r (stages 2-3)
  master weights:   S·4 when kept apart (16-bit parameters, or any offload), else none
  optimizer states: k·S·4 (AdamW: k = 2 moments)
Offload 'cpu' puts the last two on the host; 'nvme' puts them on disk and keeps one
sub-group of each in a host staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.config import Config
from plait.estimate.rank_params import ParamSpec
from plait.parallel.zero.layout import NVME_SUB_GROUP_MB, bucket_runs, nvme_sub_group, padded_size

FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq (parallel/adamw.py)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of the parameters (p) and the gradient reduction (r)."""

    name: str
    param: int
    reduce: int

    @classmethod
    def of(cls, name: str, reduce_dtype: str | None) -> ElementBytes:
        return cls(name, DTYPE_BYTES[name], DTYPE_BYTES[reduce_dtype or name])

    @classmethod
    def of_run(cls, cfg: Config) -> ElementBytes:
        """A run's ([train] precision, reduce_dtype; [lora] base_upcast): `--base-upcast`
        computes, holds and reduces in fp32 (only an NF4 base's products in the 16-bit dtype:
        `estimate/frozen_base.dequantized_bytes`)."""
        t = cfg.train
        if cfg.lora.base_upcast:
            return cls(t.precision, 4, 4)
        return cls.of(t.precision, t.reduce_dtype)


@dataclass
class States:
    """Bytes by category and place ('device', 'host', 'disk') on one rank."""

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    groups: list[tuple[int, int]] = field(default_factory=list)  # (numel, padded) per group
    blocks: list[frozenset[int | None]] = field(default_factory=list)  # each group's blocks

    def add(self, category: str, place: str, nbytes: int) -> None:
        if nbytes:
            per = self.bytes.setdefault(category, {})
            per[place] = per.get(place, 0) + nbytes

    def total(self, place: str = "device") -> int:
        return sum(per.get(place, 0) for per in self.bytes.values())


def flat_groups(
    params: list[ParamSpec],
    stage: int,
    bucket_mb: float,
    world: int,
    units: list[list[ParamSpec]] | None = None,
) -> list[tuple[int, int]]:
    """(numel, padded) of every flat group, as `zero/layout.build_groups` forms them: of the
    trainable parameters only (a LoRA run's frozen base is in no group). `units`:
    `group_units(params, stage, bucket_mb)`, where a planner keeps them."""
    units = group_units(params, stage, bucket_mb) if units is None else units
    return _sized(units, 1 if stage == 0 else world)


def _sized(units: list[list[ParamSpec]], shards: int) -> list[tuple[int, int]]:
    sizes = [sum(p.numel for p in unit) for unit in units]
    return [(n, padded_size(n, shards)) for n in sizes]


def group_units(params: list[ParamSpec], stage: int, bucket_mb: float) -> list[list[ParamSpec]]:
    """The parameters of every flat group, in the engine's group order."""
    params = [p for p in params if p.trainable]
    alone = [p for p in params if p.isolated]
    rest = [p for p in params if not p.isolated]
    if stage == 3:
        blocks = sorted({p.block for p in rest if p.block is not None}, reverse=True)
        units = [[p for p in rest if p.block == b] for b in blocks]
        units.append([p for p in rest if p.block is None])
    else:  # buckets are sized in fp32 bytes: the engine groups before casting
        runs = bucket_runs([p.numel * FP32 for p in rest], int(bucket_mb * 2**20))
        units = [[rest[i] for i in run] for run in runs]
    units += [[p] for p in alone]
    return [unit for unit in units if unit]


def model_states(
    params: list[ParamSpec],
    stage: int,
    world: int,
    precision: ElementBytes,
    offload: str = "none",
    bucket_mb: float = 25.0,
    units: list[list[ParamSpec]] | None = None,
) -> States:
    """Per-rank model states of ZeRO `stage` over `world` data-parallel ranks (`units`:
    `group_units(params, stage, bucket_mb)`, where a planner keeps them)."""
    units = group_units(params, stage, bucket_mb) if units is None else units
    shards = 1 if stage == 0 else world
    blocks = [frozenset(p.block for p in u) for u in units]
    out = States(groups=_sized(units, shards), blocks=blocks)
    full = sum(padded for _, padded in out.groups)
    shard = full // shards
    out.add("parameters", "device", (shard if stage == 3 else full) * precision.param)
    out.add("gradients", "device", (full if stage <= 1 else shard) * precision.reduce)
    separate_master = precision.param != FP32 or offload != "none"
    if offload == "nvme":
        staging = nvme_sub_group(NVME_SUB_GROUP_MB, ADAM_STATES) * FP32
        out.add("master_weights", "disk", shard * FP32)
        out.add("master_weights", "host", staging)
        out.add("optimizer_states", "disk", ADAM_STATES * shard * FP32)
        out.add("optimizer_states", "host", ADAM_STATES * staging)
        return out
    place = "host" if offload == "cpu" else "device"
    if separate_master:
        out.add("master_weights", place, shard * FP32)
    out.add("optimizer_states", place, ADAM_STATES * shard * FP32)
    return out
