"""The model contract: everything parallel code may know about a model, in one typed description.

Tensor and pipeline parallelism, recomputation, the optimizer engines, the gradient rules,
checkpoints, initialization and the memory estimator never probe a model's attributes: they
read its `ModelContract` (`contract_of(model)`):

- the pipeline *parts* in order, the embedding, block i, the final norm, the head (`Part`),
  and which of them this rank holds;
- per parameter (`ParamDecl`): its single-process shape; the parameter it is tied to, by
  canonical name; the dimension tensor parallelism splits (and, once split, this rank's
  `ShardSpec`); whether its gradient is partial under sequence parallelism; whether it trains;
- which blocks run under full recomputation.

`describe(cfg)` (models/declare.py) declares the transformer from its config alone, allocating
nothing, so the pure estimator reads the same declarations a training rank does. A
parallelizing function returns a changed copy (`tensor_parallel`, `holding`, `recomputing`) that
the model adopts (`Transformer.set_contract`, which checks it against the parameters the model
then has). A new kind of parameter, say a trainable adapter beside a frozen base weight, is
one more `ParamDecl` in `describe`: every engine learns from it what to shard, sum, skip or save.

Declarations are named by *leaf* within their part ("attn.wq.weight"), so every block shares
one tuple of declarations: describing and splitting an 80-layer model costs one block's work,
which the planner, estimating thousands of layouts, relies on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from plait.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor, nn

PartKind = Literal["embed", "block", "norm", "head"]


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor as the slice of a full parameter along one dimension.

    The local tensor holds `full[offsets[d] : offsets[d] + local_shape[d]]` followed, along
    `dim`, by `padding` zero elements that exist only so every rank's tensor has the same
    shape (a vocabulary not divisible by tp). Padding is never part of the parameter.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int
    padding: int = 0
    axis: str = "tp"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the local tensor, padding included."""
        shape = list(self.local_shape)
        shape[self.dim] += self.padding
        return tuple(shape)

    def region(self) -> tuple[slice, ...]:
        """Index of this shard's real data in the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape, strict=True))

    def unpadded(self, local: Tensor) -> Tensor:
        """The real data of a local tensor (what an exported checkpoint must contain)."""
        return local.narrow(self.dim, 0, self.local_shape[self.dim])


def split_spec(
    global_shape: tuple[int, ...], dim: int, rank: int, size: int, pad: bool = False, what: str = ""
) -> ShardSpec:
    """Rank `rank` of `size` holds a contiguous 1/size of `global_shape` along `dim`.

    With `pad`, a length not divisible by `size` is rounded up to a multiple of it and the
    missing elements become padding at the end of the last shards; without, it is an error.
    """
    n = global_shape[dim]
    if n % size and not pad:
        raise ConfigError(f"{what or 'dimension'}={n} is not divisible by tp={size}")
    per = math.ceil(n / size)
    start = rank * per
    real = max(0, min(per, n - start))
    offsets = [0] * len(global_shape)
    offsets[dim] = min(start, n)
    local = list(global_shape)
    local[dim] = real
    return ShardSpec(tuple(global_shape), tuple(offsets), tuple(local), dim, per - real)


@dataclass(frozen=True)
class ParamDecl:
    """One parameter of a part: what it is in the single-process model, and how it splits."""

    leaf: str  # name inside its part: "attn.wq.weight", "tok.weight", "weight"
    shape: tuple[int, ...]  # the single-process shape
    split_dim: int | None = None  # the dimension tensor parallelism splits; None: replicated
    padded: bool = False  # the split pads to a multiple of tp (the vocabulary)
    sp_partial: bool = False  # replicated, applied per position: partial over tp under SP
    tp_partial: bool = False  # replicated, feeding split outputs: partial over tp (LoRA's A)
    trainable: bool = True  # False: no gradient, bucket, optimizer state or master copy
    tied_to: str | None = None  # canonical name of the parameter whose values this one shares
    shard: ShardSpec | None = None  # this rank's tensor-parallel slice, once split

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the tensor a rank holds (padding included)."""
        return self.shard.shape if self.shard is not None else self.shape

    def split(self, rank: int, size: int, what: str = "") -> ParamDecl:
        """This declaration on tp rank `rank` of `size` (`what` names it in an error)."""
        if self.split_dim is None:
            return self
        spec = split_spec(self.shape, self.split_dim, rank, size, self.padded, what or self.leaf)
        return replace(self, shard=spec)


class Part(NamedTuple):
    """A unit of the pipeline: the embedding, block `index`, the final norm or the head (a
    tuple: cheap to make and read, as the estimator makes a contract per layout)."""

    kind: PartKind
    index: int | None  # the block's number; None for the ends
    path: str  # its module path in the model: "embed", "blocks.3", "norm", "head"
    params: tuple[ParamDecl, ...]

    @classmethod
    def block(cls, index: int, params: tuple[ParamDecl, ...]) -> Part:
        return cls("block", index, f"blocks.{index}", params)

    @classmethod
    def end(cls, kind: PartKind, params: tuple[ParamDecl, ...]) -> Part:
        """The embedding, the final norm or the head."""
        return cls(kind, None, kind, params)

    def with_params(self, params: tuple[ParamDecl, ...]) -> Part:
        return Part(self.kind, self.index, self.path, params)


class Declared(NamedTuple):
    """A declaration with its place: its single-process name and its part (a tuple: the
    estimator makes one per parameter for thousands of layouts)."""

    name: str
    part: Part
    decl: ParamDecl


@dataclass(frozen=True)
class ModelContract:
    """What parallel code knows about one rank's model; see the module docstring."""

    parts: tuple[Part, ...]  # every part, in pipeline (and registration) order
    held: frozenset[str] | None = None  # paths of the parts this rank holds; None: all
    tp_size: int = 1
    sequence_parallel: bool = False  # tensor parallelism splits the sequence too (SP)
    recomputed: frozenset[int] = field(default_factory=frozenset)  # full recomputation

    # -- reading ---------------------------------------------------------------------------
    @cached_property
    def _by_name(self) -> dict[str, Declared]:
        return {
            f"{part.path}.{d.leaf}": Declared(f"{part.path}.{d.leaf}", part, d)
            for part in self.parts
            for d in part.params
        }

    @cached_property
    def plain_head(self) -> bool:
        """Whether the head is declared one matmul by its weight (no bias, no adapter): then
        the lighter loss (models/light_loss.py) may stand in for it."""
        return [d.leaf for p in self.parts if p.kind == "head" for d in p.params] == ["weight"]

    def holds(self, part: Part) -> bool:
        return self.held is None or part.path in self.held

    def held_parts(self) -> tuple[Part, ...]:
        return tuple(part for part in self.parts if self.holds(part))

    def blocks(self) -> tuple[Part, ...]:
        """The blocks this rank holds, in order."""
        return tuple(part for part in self.held_parts() if part.kind == "block")

    def stage_parts(self, layers: Iterable[int], first: bool, last: bool) -> tuple[Part, ...]:
        """The parts of a pipeline stage running blocks `layers`: the embedding on the first
        stage, the final norm and the head on the last."""
        keep = {f"blocks.{i}" for i in layers}
        keep |= {"embed"} if first else set()
        keep |= {"norm", "head"} if last else set()
        return tuple(part for part in self.parts if part.path in keep)

    def entry(self, name: str) -> Declared:
        """The declaration of parameter `name` (any of its names: a tied copy's own)."""
        return self._by_name[name]

    def canonical(self, name: str) -> str:
        """The single-process name: a tied copy goes by the name of what it is tied to (its
        declared `tied_to`, the one record of a tie); any other name is its own."""
        return self._tied_copies.get(name, name)

    @cached_property
    def _tied_copies(self) -> dict[str, str]:
        return {m.name: t for t, ms in self._ties.items() for m in ms if m.decl.tied_to}

    def params(self, parts: Iterable[Part] | None = None) -> list[Declared]:
        """Each parameter of `parts` (default: every held part) once, in registration order:
        a tied copy whose target is among them is the same tensor and is skipped."""
        parts = self.held_parts() if parts is None else tuple(parts)
        paths = {part.path for part in parts}
        out = []
        for part in parts:
            prefix = part.path
            for d in part.params:
                if d.tied_to is not None and self._ties[d.tied_to][0].part.path in paths:
                    continue
                out.append(Declared(f"{prefix}.{d.leaf}", part, d))
        return out

    def bind(
        self, model: nn.Module, parts: Iterable[Part] | None = None
    ) -> list[tuple[Declared, nn.Parameter]]:
        """`params(parts)` with the model's parameter of each."""
        return [(e, model.get_parameter(e.name)) for e in self.params(parts)]

    def shards(self) -> dict[str, ShardSpec]:
        """Name -> ShardSpec of every tensor-parallel shard this rank holds."""
        return {e.name: e.decl.shard for e in self.params() if e.decl.shard is not None}

    @cached_property
    def _ties(self) -> dict[str, tuple[Declared, ...]]:
        """Canonical name -> every declared member of its tie, the target first. Found
        without naming every parameter: the estimator asks it of a new contract per layout."""
        groups: dict[str, list[Declared]] = {}
        scanned: dict[int, bool] = {}  # blocks share one tuple: look at it once
        for part in self.parts:
            if id(part.params) not in scanned:
                scanned[id(part.params)] = any(d.tied_to for d in part.params)
            if scanned[id(part.params)]:
                for d in part.params:
                    if d.tied_to:
                        groups.setdefault(d.tied_to, []).append(
                            Declared(f"{part.path}.{d.leaf}", part, d)
                        )
        for part in self.parts if groups else ():
            for d in part.params:
                name = f"{part.path}.{d.leaf}"
                if name in groups:
                    groups[name].insert(0, Declared(name, part, d))
        return {name: tuple(members) for name, members in groups.items()}

    def tied(self, entry: Declared) -> bool:
        """Whether `entry` shares its values with another declared parameter."""
        return entry.decl.tied_to is not None or entry.name in self._ties

    def split_ties(self) -> frozenset[str]:
        """Names of the tied parameters this rank holds whose tie has a member on another
        rank: a pipeline end's copy of a tied embedding, summed over the pipeline ends and
        given a flat group of its own."""
        return frozenset(
            m.name
            for members in self._ties.values()
            if not all(self.holds(m.part) for m in members)
            for m in members
            if self.holds(m.part)
        )

    # -- changing (each returns a new contract) --------------------------------------------
    def tensor_parallel(self, rank: int, size: int, sequence_parallel: bool) -> ModelContract:
        """Every split declaration given tp rank `rank`'s shard of `size`."""
        split: dict[int, tuple[ParamDecl, ...]] = {}  # blocks share one tuple: split it once
        parts = []
        for part in self.parts:
            if id(part.params) not in split:
                split[id(part.params)] = tuple(d.split(rank, size) for d in part.params)
            parts.append(part.with_params(split[id(part.params)]))
        return replace(self, parts=tuple(parts), tp_size=size, sequence_parallel=sequence_parallel)

    def with_shards(self, specs: Mapping[str, ShardSpec]) -> ModelContract:
        """The given parameters as shards (by name); for layouts `tensor_parallel` does not
        make (a test's irregular slice)."""
        return self._changed(specs, lambda d, spec: replace(d, shard=spec))

    def freezing(self, names: Iterable[str]) -> ModelContract:
        """The given parameters frozen (`trainable` False): no gradient, no flat group, no
        optimizer state, no master copy, in every engine."""
        return self._changed(dict.fromkeys(names), lambda d, _: replace(d, trainable=False))

    def _changed(self, by_name: Mapping[str, Any], change: Callable) -> ModelContract:
        """`change(decl, by_name[name])` for each declared name in `by_name`; a part whose
        declarations all stay keeps its tuple (blocks keep sharing theirs)."""
        unknown = set(by_name) - self._by_name.keys()
        if unknown:
            raise KeyError(f"no such parameters declared: {sorted(unknown)}")
        parts = []
        for part in self.parts:
            names = [f"{part.path}.{d.leaf}" for d in part.params]
            if any(n in by_name for n in names):
                params = tuple(
                    change(d, by_name[n]) if n in by_name else d
                    for n, d in zip(names, part.params, strict=True)
                )
                part = part.with_params(params)
            parts.append(part)
        return replace(self, parts=tuple(parts))

    def holding(self, parts: Iterable[Part]) -> ModelContract:
        """Only `parts` held (a pipeline rank's stages)."""
        return replace(self, held=frozenset(part.path for part in parts))

    def recomputing(self, blocks: Iterable[int]) -> ModelContract:
        """Blocks `blocks` run under full recomputation."""
        return replace(self, recomputed=self.recomputed | frozenset(blocks))

    # -- the model side --------------------------------------------------------------------
    def tie(self, model: nn.Module) -> None:
        """Make each tied copy the same Parameter as its target where this rank holds both
        (`Module.to_empty` and `_apply` untie them)."""
        for part in self.held_parts():
            for d in part.params:
                target = self._ties[d.tied_to][0] if d.tied_to else None
                if target is not None and self.holds(target.part):
                    owner, _, leaf = f"{part.path}.{d.leaf}".rpartition(".")
                    setattr(model.get_submodule(owner), leaf, model.get_parameter(target.name))

    def check(self, model: nn.Module) -> None:
        """Raise unless `model`'s parameters are exactly the declared ones, by name, order and
        local shape: an undeclared parameter would be invisible to every engine."""
        declared = [(e.name, e.decl.local_shape) for e in self.params()]
        actual = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        if declared != actual:
            diff = next(
                ((d, a) for d, a in zip(declared, actual, strict=False) if d != a),
                (declared[len(actual) :][:1], actual[len(declared) :][:1]),
            )
            raise ValueError(
                f"{type(model).__name__}'s parameters differ from its contract "
                f"(declared, actual): {diff}"
            )


def contract_of(model: nn.Module) -> ModelContract:
    """The contract `model` carries: the only way parallel code learns about a model."""
    contract = model.__dict__.get("contract")
    if not isinstance(contract, ModelContract):
        raise ConfigError(
            f"{type(model).__name__} declares no model contract (plait.models.contract): "
            "parallel code learns a model's parts and parameters only from it"
        )
    return contract
