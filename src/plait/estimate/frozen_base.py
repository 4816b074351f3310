"""A LoRA run's frozen base on one rank: its bytes, its gathered units, its traffic.

The ZeRO engine holds the base apart from the trainable flat groups (parallel/zero/frozen.py):

- stages 0-2: whole on every data-parallel rank, never gathered: Ψ_r·b bytes (Ψ_r the
  base elements this rank's tp shard and pipeline stages hold, b the `--base-dtype` bytes);
- stage 3: in flat groups of its own, one per block and one for the root (embedding, final
  norm, head), each padded to a multiple of N = dp (`layout.frozen_groups`), so a rank holds
  Σ P/N·b; each unit is all-gathered before its forward and again before its backward,
  2·m·Σ P elements per step over m micro-batches (tag "frozen"), and freed after. At most
  the root and two blocks are gathered at once (the unit running and the next, prefetched);
  near the activations' peak the root and the last block, or the last two blocks. Under a
  pipeline the base is kept gathered through the step (`kept`: once per step, the whole
  stage held) unless `--reshard-after-forward always` (estimate/zero_pipeline.py).

`--base-dtype nf4` (QLoRA): the blocks' Linear weights in NF4 (parallel/zero/nf4_base.py),
`models/nf4/format.held_bytes` each (4.127 bits per weight of this rank's slice, plus the whole
weight's nested scales and offset), the rest of the base in the precision's dtype. Under
stage 3 each block's packed bytes are a second flat buffer beside its fp one, padded to a
multiple of N (zero/nf4_shards.py), and the nested scales and offsets stay whole on every
rank: the units are then counted in bytes (`element` 1), each block's fp part times its
dtype's bytes plus its packed bytes, so the gathers, peaks and traffic below are bytes.

This module is the one place the estimator and the planner (plan/traffic.py) read those
figures from, so memory and traffic come from the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import Config
from plait.estimate.lines import FROZEN, Line
from plait.estimate.model_states import DTYPE_BYTES, ElementBytes
from plait.estimate.rank_params import ParamSpec
from plait.mixed_precision import check_base_dtype
from plait.models.architecture import ModelConfig
from plait.models.declare import block_params, is_adapter
from plait.models.nf4.format import held_bytes
from plait.parallel.zero.layout import padded_size


def base_bytes(base_dtype: str, prec: ElementBytes) -> int:
    """Bytes per element of a LoRA run's frozen base: `--base-dtype`, auto = the
    precision's parameter dtype (2 under bf16/fp16, 4 under fp32); under nf4 that of what is
    not quantized (`nf4_weights` prices the rest)."""
    check_base_dtype(base_dtype)
    return prec.param if base_dtype in ("auto", "nf4") else DTYPE_BYTES[base_dtype]


def nf4_weights(params: list[ParamSpec], model: ModelConfig) -> tuple[int, int]:
    """(elements, bytes) of the NF4-held weights among `params` (a rank's, `rank_params`):
    the frozen 2-D weights of its blocks, each `held_bytes` of its slice."""
    whole = _quantized(model)
    numel = held = 0
    for p in params:
        leaf = p.name.split(".", 2)[-1]
        if p.block is not None and not p.trainable and leaf in whole:
            numel += p.numel
            held += held_bytes(p.numel, whole[leaf])
    return numel, held


def dequantized_bytes(params: list[ParamSpec], cfg: Config) -> int:
    """An NF4 base's weight dequantized for its product (models/nf4/linear.py): one at a
    time, the largest of this rank's slices, in the products' dtype (the precision's, 16-bit
    under `--base-upcast`); alive within a block's forward or backward only (estimate/peak.py).
    0 for any other base."""
    if cfg.lora.base_dtype != "nf4":
        return 0
    whole = _quantized(cfg.model)
    sizes = [p.numel for p in params if p.block is not None and not p.trainable
             and p.name.split(".", 2)[-1] in whole]  # fmt: skip
    return max(sizes, default=0) * DTYPE_BYTES[cfg.train.precision]


def base_total_bytes(cfg: Config, prec: ElementBytes, psi: int) -> int:
    """A single process's whole frozen base of `psi` elements, in `--base-dtype`."""
    e = base_bytes(cfg.lora.base_dtype, prec)
    if cfg.lora.base_dtype != "nf4":
        return e * psi
    sizes = _quantized(cfg.model).values()
    layers = cfg.model.n_layers
    return layers * sum(held_bytes(n, n) for n in sizes) + e * (psi - layers * sum(sizes))


def _quantized(model: ModelConfig) -> dict[str, int]:
    """Each block Linear weight held in NF4, by its leaf in a block: its whole elements."""
    return {d.leaf: d.shape[0] * d.shape[1] for d in block_params(model)
            if len(d.shape) == 2 and not is_adapter(d.leaf)}  # fmt: skip


@dataclass(frozen=True)
class FrozenBase:
    """The frozen base of one (pp, tp) rank: its units' (numel, padded) in the engine's
    order (blocks last to first, then the root; empty ones left out) and how it is held."""

    units: tuple[tuple[int, int], ...]
    has_root: bool
    stage: int
    world: int  # dp
    element: int  # bytes per element (--base-dtype)
    blocks: tuple[int, ...] = ()  # each block unit's block number, in unit order
    kept: bool = False  # stage 3 under a pipeline, kept gathered through the step
    nf4: tuple[int, int] = (0, 0)  # (elements, bytes) held in NF4 (stages 0-2)
    constants: int = 0  # stage 3 with NF4: the nested scales and offsets, whole per rank
    packed: tuple[int, ...] = ()  # stage 3 with NF4: each unit's packed flat group (padded B)

    def unit_blocks(self) -> list[frozenset[int | None]]:
        """Each unit's block (None: the root), as `zero_pipeline` reads flat groups."""
        out = [frozenset([b]) for b in self.blocks]
        return out + [frozenset([None])] * (len(self.units) - len(out))

    @property
    def numel(self) -> int:
        return sum(n for n, _ in self.units)

    @property
    def padded(self) -> int:
        return sum(p for _, p in self.units)

    def held(self) -> int:
        """Bytes this rank keeps between uses: the whole base, or its shards (stage 3)."""
        if self.stage != 3:
            return (self.numel - self.nf4[0]) * self.element + self.nf4[1]
        return self.padded // self.world * self.element + self.constants

    def flat_groups(self) -> tuple[list[tuple[int, int]], list[frozenset[int | None]]]:
        """The flat groups all-gathered, (numel, padded) each, and each one's block: a unit
        is one group, an NF4 block's two (its fp group and its packed bytes, gathered one
        after the other: zero/nf4_shards.py), so the calls are counted whole."""
        groups, blocks = [], []
        packed = self.packed or (0,) * len(self.units)
        for (numel, padded), extra, block in zip(
            self.units, packed, self.unit_blocks(), strict=True
        ):
            parts = (
                [(numel - extra, padded - extra), (extra, extra)] if extra else [(numel, padded)]
            )
            for part in parts:
                if part[1]:
                    groups.append(part)
                    blocks.append(block)
        return groups, blocks

    def _blocks_and_root(self) -> tuple[list[int], int]:
        padded = [p for _, p in self.units]
        if self.has_root:
            return sorted(padded[:-1], reverse=True), padded[-1]
        return sorted(padded, reverse=True), 0

    def gathered_peak(self) -> int:
        """Stage 3: the most gathered at once, the root and two blocks (bytes); else 0."""
        if self.stage != 3:
            return 0
        if self.kept:
            return self.padded * self.element
        blocks, root = self._blocks_and_root()
        return (root + sum(blocks[:2])) * self.element

    def gathered_at_activation_peak(self) -> int:
        """Stage 3: gathered while the activations are (nearly) at their peak: the root
        and the last block as the backward starts, two blocks once the last block's
        backward begins (only the head's saved tensors freed by then); the larger."""
        if self.stage != 3:
            return 0
        if self.kept:
            return self.padded * self.element
        blocks, root = self._blocks_and_root()
        return max(root + sum(blocks[:1]), sum(blocks[:2])) * self.element

    def gathered_per_step(self, micro_batches: int) -> int:
        """Elements all-gathered per step (stage 3, dp > 1): every unit twice per
        micro-batch, whole (padded) as the communication counts report them."""
        if self.stage != 3 or self.world == 1:
            return 0
        return self.padded if self.kept else 2 * micro_batches * self.padded


def frozen_base(params: list[ParamSpec], cfg: Config, prec: ElementBytes) -> FrozenBase:
    """The frozen base of the rank holding `params` (`rank_params`), as the engine holds it
    (`layout.block_units(trainable=False)`: blocks in reverse order, then the root)."""
    par = cfg.parallel
    frozen = [p for p in params if not p.trainable]
    blocks = sorted({p.block for p in frozen if p.block is not None}, reverse=True)
    sizes = [sum(p.numel for p in frozen if p.block == b) for b in blocks]
    root = sum(p.numel for p in frozen if p.block is None)
    sizes.append(root)
    shards = par.dp if cfg.memory.zero == 3 else 1
    units = tuple((n, padded_size(n, shards)) for n in sizes if n)
    e = base_bytes(cfg.lora.base_dtype, prec)
    kept = par.pp > 1 and not par.two_bw and cfg.memory.reshard_after_forward != "always"
    held = tuple(b for b, n in zip(blocks, sizes, strict=False) if n)
    if cfg.lora.base_dtype == "nf4" and cfg.memory.zero == 3:
        return _sharded_nf4(frozen, cfg, e, blocks, held, kept)
    nf4 = nf4_weights(frozen, cfg.model) if cfg.lora.base_dtype == "nf4" else (0, 0)
    return FrozenBase(
        units, root > 0, cfg.memory.zero, par.dp, e, held, kept and cfg.memory.zero == 3, nf4
    )


def _sharded_nf4(
    frozen: list[ParamSpec], cfg: Config, e: int, blocks: list[int], held: tuple, kept: bool
) -> FrozenBase:
    """Stage 3 over an NF4 base, in bytes: each block unit its fp flat group (e bytes per
    element, padded to N elements) and its packed flat group (codes and absmax codes, padded
    to N bytes); the root fp; the nested scales and offsets whole beside the shards."""
    whole, n = _quantized(cfg.model), cfg.parallel.dp
    quantized = [p for p in frozen if p.block is not None and p.name.split(".", 2)[-1] in whole]
    names = {p.name for p in quantized}
    units, constants, split = [], 0, []
    for b in [*blocks, None]:
        fp = sum(p.numel for p in frozen if p.block == b and p.name not in names)
        packed = sum(-(-p.numel // 2) + -(-p.numel // 64) for p in quantized if p.block == b)
        units.append((fp * e + packed, padded_size(fp, n) * e + padded_size(packed, n)))
        split.append(padded_size(packed, n))
    for p in quantized:
        leaf = p.name.split(".", 2)[-1]
        constants += held_bytes(p.numel, whole[leaf]) - -(-p.numel // 2) - -(-p.numel // 64)
    root, root_split = units.pop(), split.pop()
    kept_units = [(u, x) for u, x in zip(units, split, strict=True) if u[0]]
    kept_units += [(root, root_split)] if root[0] else []
    return FrozenBase(tuple(u for u, _ in kept_units), root[0] > 0, 3, n, 1, held, kept,
                      constants=constants, packed=tuple(x for _, x in kept_units))  # fmt: skip


def frozen_line(base: FrozenBase, cfg: Config) -> Line:
    """The 'frozen_base' line: what the rank keeps, with the formula and, under stage 3,
    the bytes it all-gathers per step."""
    name = cfg.lora.base_dtype
    name = f"{cfg.train.precision} = auto" if name == "auto" else name
    e = base.element
    if base.stage == 3 and base.constants:
        why = (
            f"{base.padded // base.world:,} B (base nf4, ZeRO-3: {len(base.units)} units of "
            f"fp {cfg.train.precision} and packed NF4 bytes, padded to {base.padded:,} B, 1/"
            f"{base.world} each) + {base.constants:,} B of nested scales and offsets, whole"
        )
        gathered = base.gathered_per_step(cfg.accumulation)
        if gathered:
            why += f"; all-gathers {gathered:,} B per step"
        return Line(FROZEN, base.held(), formula=why)
    if base.stage != 3 and base.nf4[0]:
        rest, (q, held) = base.numel - base.nf4[0], base.nf4
        why = (
            f"{q:,} el in NF4 = {held:,} B (4.127 bits each + 4 B per weight) + {rest:,} el "
            f"x {e} B ({cfg.train.precision}), replicated over dp (ZeRO-{cfg.memory.zero})"
        )
        return Line(FROZEN, base.held(), formula=why)
    if base.stage != 3:
        why = (
            f"{base.numel:,} el x {e} B (base {name}), replicated over dp (ZeRO-{cfg.memory.zero})"
        )
        return Line(FROZEN, base.held(), formula=why)
    why = (
        f"{base.padded // base.world:,} el x {e} B (base {name}; ZeRO-3: "
        f"{len(base.units)} units padded to {base.padded:,}, 1/{base.world} each)"
    )
    gathered = base.gathered_per_step(cfg.accumulation)
    if gathered and base.kept:
        why += f"; all-gathers {base.padded:,} el = {gathered * e:,} B once per step (kept)"
    elif gathered:
        why += (
            f"; all-gathers 2 x {cfg.accumulation} micro-batches x {base.padded:,} el = "
            f"{gathered * e:,} B per step"
        )
    return Line(FROZEN, base.held(), formula=why)
