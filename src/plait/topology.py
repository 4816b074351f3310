"""Pure rank arithmetic: which (pp, dp, cp, tp) coordinate each global rank holds.

Rank order puts tp fastest, then cp, then dp, then pp, because tensor parallelism exchanges
the most bytes per step, context parallelism the next most (every layer's keys and values),
and consecutive ranks share a node's fastest links (Megatron's order). Nothing
here touches torch.distributed, so every rule is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Axis names, slowest-varying first. A new axis (ep) is added here and in Layout."""


@dataclass(frozen=True)
class Coord:
    """One rank's position on every axis."""

    pp: int
    dp: int
    tp: int
    cp: int = 0

    def get(self, axis: str) -> int:
        return getattr(self, axis)


@dataclass(frozen=True)
class Layout:
    """How many ranks each parallel axis has; world size is their product."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"{axis} must be a positive integer, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def shape(self) -> tuple[int, ...]:
        """Mesh shape in AXES order (slowest first)."""
        return tuple(self.size(a) for a in AXES)

    def coord(self, rank: int) -> Coord:
        """Global rank -> coordinates (tp fastest, then cp, then dp, then pp)."""
        self._check_rank(rank)
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coord(pp=pp, dp=dp, tp=tp, cp=cp)

    def rank(self, coord: Coord) -> int:
        """Coordinates -> global rank; the inverse of coord()."""
        for axis in AXES:
            if not 0 <= coord.get(axis) < self.size(axis):
                raise ConfigError(
                    f"{axis} coordinate {coord.get(axis)} out of range for {axis}={self.size(axis)}"
                )
        return ((coord.pp * self.dp + coord.dp) * self.cp + coord.cp) * self.tp + coord.tp

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that differ from `rank` only along `axis`, in axis order."""
        c = self.coord(rank)
        out = []
        for i in range(self.size(axis)):
            values = {a: (i if a == axis else c.get(a)) for a in AXES}
            out.append(self.rank(Coord(**values)))
        return out

    def replica_ranks(self, rank: int) -> list[int]:
        """Global ranks that differ from `rank` only along dp and cp, in rank order: the
        ranks that share a model's gradients (each holds other tokens), over which ZeRO
        shards and the gradients are reduced."""
        return sorted({q for p in self.axis_ranks("cp", rank) for q in self.axis_ranks("dp", p)})

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each listed once, ordered by their lowest rank.

        All ranks must create process groups in this same order.
        """
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.axis_ranks(axis, r)), None)
        return [list(g) for g in seen]

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            cp = ("*cp", f"*{self.cp}") if self.cp > 1 else ("", "")
            raise ConfigError(
                f"world size {world_size} != dp*pp*tp{cp[0]} = {self.dp}*{self.pp}*{self.tp}"
                f"{cp[1]} = {self.world_size}"
            )

    def describe(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp} pp={self.pp} tp={self.tp}{cp} (world {self.world_size})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} out of range for world size {self.world_size}")
