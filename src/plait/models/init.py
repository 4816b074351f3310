"""Layout-independent initialization: every parameter's initial value is a pure function of
(config, parameter name, shape, seed), so a tensor-parallel shard, a pipeline stage or a ZeRO
shard is filled with exactly its slice of the single-process model's weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.models.contract import contract_of
from plait.models.declare import describe, is_adapter
from plait.models.lora import lora_a_value
from plait.models.transformer import Transformer

MODEL_WEIGHTS = frozenset({"embed.tok", "embed.pos", "head"})
"""The weights outside the blocks drawn from N(0, init_std); a block's come from its table."""
# Name components that wrappers insert (DDP, torch.compile, checkpoint_wrapper, FSDP).
WRAPPER_NAMES = frozenset(
    {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)


def canonical_name(cfg: ModelConfig, name: str) -> str:
    """The single-process parameter name: wrapper components dropped, a tied copy by the name
    of what it is tied to (the contract's `canonical`, from its declarations)."""
    name = ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)
    return describe(cfg).canonical(name)


def _weight_std(cfg: ModelConfig, owner: str) -> float | None:
    """The std of the weight of module `owner` ('blocks.3.attn.wo', 'head'), None if it is
    no Linear or embedding: init_std, over sqrt(2 n_layers) for a residual output (the
    block table's `residual` rows)."""
    if owner in MODEL_WEIGHTS:
        return cfg.init_std
    block, _, path = owner.partition(".")
    rows = {r.path: r for r in block_table(cfg).linears}
    if block != "blocks" or path.partition(".")[2] not in rows:
        return None
    row = rows[path.partition(".")[2]]
    return cfg.init_std / math.sqrt(2 * cfg.n_layers) if row.residual else cfg.init_std


def _seed_for(seed: int, name: str) -> int:
    """Stable 63-bit seed from (seed, name); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"plait-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """Full fp32 initial value of parameter `name`, a pure function of (cfg, name, shape, seed).

    Each parameter has its own generator, so the value does not depend on which other
    parameters exist on a rank or in what order they are initialized: a tensor-parallel
    shard or pipeline stage slices this and matches the single-process model exactly.
    Weights ~ N(0, init_std), residual output projections scaled by 1/sqrt(2 n_layers)
    (GPT-2, Radford et al., 2019), biases 0, norm weights 1 (Gemma's, which scale by 1 + w: 0).
    """
    name = canonical_name(cfg, name)
    owner, _, leaf = name.rpartition(".")
    if leaf in ("bias", "lora_b"):  # LoRA's B starts at zero: the first step is the base's
        return torch.zeros(shape)
    if leaf == "lora_a":
        return lora_a_value(shape, torch.Generator().manual_seed(_seed_for(seed, name)))
    if owner.rpartition(".")[2].endswith("norm") and leaf == "weight":  # Gemma's: 1 + w
        return torch.zeros(shape) if cfg.gemma else torch.ones(shape)
    std = _weight_std(cfg, owner) if leaf == "weight" else None
    if std is None:
        raise ValueError(f"init_value does not know how to initialize parameter {name!r}")
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


class ShardLike(Protocol):
    """What init needs to know about a shard (plait.models.contract.ShardSpec has it)."""

    @property
    def global_shape(self) -> tuple[int, ...]: ...
    @property
    def offsets(self) -> tuple[int, ...]: ...
    @property
    def local_shape(self) -> tuple[int, ...]: ...


def padded(shape: tuple[int, ...], shard: ShardLike, real: Tensor) -> Tensor:
    """A local tensor of `shape` holding `real` (the shard's data, of `shard.local_shape`)
    first along every dimension; the rest is padding and zero."""
    out = torch.zeros(shape)
    out[tuple(slice(0, n) for n in shard.local_shape)] = real
    return out


def shard_value(
    cfg: ModelConfig, name: str, shape: tuple[int, ...], shard: ShardLike, seed: int
) -> Tensor:
    """Initial value of a parameter shard: its slice of the full init_value, padding zero.

    `shard` describes the local tensor (of `shape`) as a slice of the full parameter: it has
    `global_shape`, `offsets` and `local_shape` (the extent of real data). Elements of the
    local tensor beyond `local_shape` are padding (e.g. vocabulary rows added so that tensor
    parallelism splits evenly) and start, and stay, zero.
    """
    full = init_value(cfg, name, tuple(shard.global_shape), seed)
    region = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.local_shape, strict=True))
    return padded(shape, shard, full[region])


ValueSource = Callable[[str, tuple[int, ...], ShardLike | None], Tensor]
"""(parameter name, local shape, shard or None) -> the local fp32 tensor. Where a run's first
weights come from: the seed (`seeded`) or a Hugging Face folder (`plait.models.hf.load`)."""


def seeded(cfg: ModelConfig, seed: int) -> ValueSource:
    """The seeded initialization as a value source (layout independent, see init_value)."""

    def value(name: str, shape: tuple[int, ...], shard: ShardLike | None) -> Tensor:
        if shard is None:
            return init_value(cfg, name, shape, seed)
        return shard_value(cfg, name, shape, shard, seed)

    return value


def with_adapters(
    base: ValueSource, cfg: ModelConfig, seed: int, adapters: ValueSource | None = None
) -> ValueSource:
    """`base` for the base model's parameters, `adapters` (default: the seeded init) for
    LoRA's: a LoRA run's first weights when its base comes from a folder (`--init-from`) and
    its adapters from the seed or a PEFT folder (`--adapter`)."""
    adapters = adapters if adapters is not None else seeded(cfg, seed)

    def value(name: str, shape: tuple[int, ...], shard: ShardLike | None) -> Tensor:
        return (adapters if is_adapter(name) else base)(name, shape, shard)

    return value


def initial_values(
    model: Transformer, seed: int, cfg: ModelConfig | None = None
) -> Callable[[nn.Parameter], Tensor]:
    """A function from each parameter of `model` to its seeded fp32 initial value."""
    cfg = cfg if cfg is not None else model.cfg
    return source_values(model, seeded(cfg, seed))


def source_values(model: nn.Module, source: ValueSource) -> Callable[[nn.Parameter], Tensor]:
    """A function from each parameter of `model` to its fp32 value from `source` (CPU).

    The value depends on the parameter's name (its first name: a tied weight keeps the
    embedding's) and, for a tensor-parallel shard, on its `ShardSpec` (both from the model's
    contract; see `shard_value`), never on the parameter's storage: `model` may still be on
    the meta device, so a sharded engine can fill its shards one group at a time (ZeRO stage
    3) without the whole model ever being materialized.
    """
    where: dict[int, tuple[str, ShardLike | None]] = {
        id(param): (entry.name, entry.decl.shard) for entry, param in contract_of(model).bind(model)
    }

    def value(param: nn.Parameter, rows: tuple[int, int] | None = None) -> Tensor:
        """The local tensor, or only its dim-0 rows [r0, r1) (what a ZeRO-3 shard needs:
        a source then reads no more than those rows)."""
        name, shard = where[id(param)]
        shape = tuple(param.shape)
        if rows is None:
            return source(name, shape, shard)
        return source(name, (rows[1] - rows[0], *shape[1:]), row_band(shape, shard, *rows))

    return value


@dataclass(frozen=True)
class Band:
    """A ShardLike for rows [r0, r1) of a local tensor (itself maybe a tp shard)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]


def row_band(shape: tuple[int, ...], shard: ShardLike | None, r0: int, r1: int) -> Band:
    """Rows [r0, r1) of a local tensor of `shape` as a slice of the full parameter. Padding
    (vocabulary rows beyond the real ones, always at the end of dim 0) stays out of it."""
    if shard is None:
        return Band(shape, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))
    real = shard.local_shape[0]
    offsets = (shard.offsets[0] + min(r0, real), *shard.offsets[1:])
    local = (max(0, min(r1, real) - r0), *shard.local_shape[1:])
    return Band(tuple(shard.global_shape), offsets, local)


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in `model` (a tied weight: the embedding's)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def init_parameters(model: Transformer, seed: int, cfg: ModelConfig | None = None) -> None:
    """Fill every parameter of `model` from the seeded init (`cfg` defaults to `model.cfg`)."""
    cfg = cfg if cfg is not None else model.cfg
    fill_parameters(model, seeded(cfg, seed))


@torch.no_grad()
def fill_parameters(model: nn.Module, source: ValueSource) -> None:
    """Fill every parameter of `model` (any device, already materialized) from `source`.

    Tied weights are re-tied first (`ModelContract.tie`). A parameter the model's contract
    declares a shard (see `shard_value`) is a slice of a larger one (tensor parallelism) and
    gets exactly that slice of the full value, so every layout starts from the same weights.
    """
    contract_of(model).tie(model)  # Module.to_empty and _apply untie them
    value = source_values(model, source)
    names = parameter_names(model)
    done: set[int] = set()  # a tied weight appears under two modules; fill it once
    for param in model.parameters():
        if id(param) in done:
            continue
        done.add(id(param))
        if param.is_meta:
            raise ValueError(
                f"parameter {names[id(param)]!r} is on the meta device; call to_empty first"
            )
        param.copy_(value(param))
