"""LoRA (Hu et al., 2021): a frozen Linear W plus a trainable low-rank update, as PEFT does it.

    y = W x + b + (alpha / r) * B (A dropout(x)),    A: (r, in) random,  B: (out, r) zero

so the first step starts exactly at the base model. PEFT's conventions, kept so that its
adapters load here and ours there: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with
a = sqrt(5)), B = 0, scaling alpha / r, dropout on the adapter's input only, no bias.

Targets are named by the block table's words (models/block_table.py, PEFT's LLaMA names without
`_proj`): q, k, v, o, gate, up, down, or the groups attn, mlp, all. GPT-2 fuses q, k and v in one
projection (Hugging Face's `c_attn`), which PEFT adapts with one A over the shared input and one B
over the three outputs; plait keeps q, k, v separate Linears, so on GPT-2 the A lives on `wq` and
`wk`, `wv` hold only their rows of B (the attention computes A x once and hands it to all three):
the same function and the same gradients as PEFT's fused adapter, and the three are targeted
together or not at all. Which Linears share an A is the table's: the rows stacked in one Hugging
Face module. The MLP's `up` and `down` are GPT-2's c_fc and c_proj.

The base is frozen by the model's contract (models/declare.py): no gradient, no bucket, no
optimizer state, no master copy. This module holds the rules (`LoRASpec`) and the layer; the
tensor-parallel forms are in parallel/tp/layers.py and call `adapter_input`.

How LoRA works under tensor parallelism. A and B are split along the dimension each shares
with the base weight where the weight is split there, else replicated (`declare.adapter_params`
declares it; the tp layers build their parameters from those declarations):

- a column-parallel target (q, k, v, gate, up: W split by output): B is split by output like
  W and A replicated, so each rank adds its output slice of B (A x) to its slice of W x, with
  no collective. A's gradient on each rank comes through its own slice of B only, so it is
  partial over tp whatever the layout (the contract's `tp_partial`); `parallel/grads.py` sums
  it over tp once per step, in the same flat all-reduce as the sequence-parallel partials.
- a row-parallel target (o, down: W split by input): A is split by input like W, so each
  rank's A x is a partial sum, like its W x. `RowParallelLinear` appends A x's r features to
  W x before the block's one all-reduce (reduce-scatter under SP, parallel/tp/mappings.py),
  which then sums both; the replicated B is applied after it, per position, so under SP its
  gradient is partial like a row-parallel bias (`sp_partial`). The adapter's dropout mask on
  the split input is this rank's slice of the whole one (`ShardedDropout`), so it does not
  depend on the layout.

The engines learn from the same declarations which parameters train (the frozen base: no
gradient, bucket or state; under ZeRO-3 it is gathered, never reduced: parallel/zero/frozen.py),
and the planner prices the extra traffic (plan/traffic.py). docs/lora.md has the bytes;
tests/test_lora_layouts.py shows tp and tp + SP equal to one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import ConfigError
from plait.models.block_table import COUNTS, LINEAR_PATHS, count_words, table_for
from plait.models.dropout import KeyedDropout

GROUPS = {"attn": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}
"""Target words that name several: a block's sublayer (what the architecture has of it)."""

ADAPTER_LEAVES = ("lora_a", "lora_b")
"""The last component of an adapter parameter's name."""

LORA_SITE = 1 << 24
"""Dropout sites of adapters: LORA_SITE + 16 * layer + the target's index (models/dropout.py)."""


@dataclass(frozen=True)
class LoRASpec:
    """One run's adapters: rank r, alpha (scaling alpha / r), dropout, and the targeted
    Linears by their path in a block (in registration order), each with the path of the
    Linear holding its A (itself, or the first of the rows stacked in its Hugging Face
    module: GPT-2's wk and wv use wq's)."""

    rank: int
    alpha: float
    dropout: float
    leaves: tuple[str, ...]
    owners: tuple[str, ...]  # per leaf: the leaf whose A it uses

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def a_of(self, leaf: str) -> str:
        """The targeted Linear whose A the one at `leaf` uses (itself unless shared)."""
        return self.owners[self.leaves.index(leaf)]

    def has_a(self, leaf: str) -> bool:
        """Whether the Linear at `leaf` holds its own A (GPT-2's wk and wv use wq's)."""
        return self.a_of(leaf) == leaf

    def site(self, layer: int, leaf: str) -> int:
        """The adapter's dropout site; Linears sharing one A share its input and mask."""
        return LORA_SITE + 16 * layer + LINEAR_PATHS.index(self.a_of(leaf))


def check_given_targets(text: object) -> None:
    """An explicit --lora-targets (flag or TOML) that names nothing is refused: leaving the
    flag out is how PEFT's default is asked for, and an empty value (a shell variable that
    was never set) must not stand for it unsaid."""
    if isinstance(text, str) and not text.replace(",", " ").strip():
        raise ConfigError(
            f"--lora-targets {text!r} names no target: leave it out for PEFT's default "
            "(LLaMA q,v; GPT-2 q,k,v) or name them (q,k,v,o,gate,up,down, attn, mlp, all)"
        )


def parse_targets(text: str, arch: str) -> tuple[str, ...]:
    """'q,v', 'attn', 'mlp', 'all' (or '' for PEFT's default) -> target words, in the block
    table's order (`table_for(arch)`); an unknown or absent name is refused, naming the known
    ones."""
    table = table_for(arch)
    known = table.targets
    names: list[str] = []
    for word in (w.strip() for w in text.split(",")) if text.strip() else table.default_targets:
        expanded = known if word == "all" else GROUPS.get(word, (word,))
        for name in expanded:
            if name not in known and word in GROUPS:
                continue  # a group names what the architecture has
            if name not in known:
                raise ConfigError(
                    f"--lora-targets {text!r}: unknown target {name!r} for this {table.name} "
                    f"model; known: {', '.join(known)}, attn, mlp, all"
                )
            names.append(name)
    return tuple(n for n in known if n in names)


def lora_spec(
    rank: int | None, alpha: float, dropout: float, targets: str, arch: str
) -> LoRASpec | None:
    """The adapters a model config asks for (None without a rank), checked: the Linears
    stacked in one Hugging Face module share one adapter there, so they are targeted
    together or not at all."""
    if rank is None:
        return None
    table = table_for(arch)
    names = parse_targets(targets, arch)
    leaves = tuple(table.targets[n] for n in names)
    for leaf in leaves:
        rows = table.fused(leaf)
        words = [r.target for r in rows]
        if any(r.path not in leaves for r in rows):
            raise ConfigError(
                f"--lora-targets {targets!r}: {table.name} computes {count_words(words)} in "
                f"one projection ({rows[0].hf.rpartition('.')[2]}); target "
                f"{COUNTS[len(rows)]} (or {rows[0].sublayer!r}) or none of them"
            )
    return LoRASpec(
        rank, alpha, dropout, leaves, tuple(table.fused(leaf)[0].path for leaf in leaves)
    )


def check_rank(spec: LoRASpec, widths: dict[str, tuple[int, int]]) -> None:
    """A rank above a target's smaller side is no low-rank update; refused, naming it."""
    for leaf in spec.leaves:
        out_f, in_f = widths[leaf]
        if spec.rank > min(out_f, in_f):
            raise ConfigError(
                f"--lora-rank {spec.rank} exceeds the width of {leaf} ({in_f} -> {out_f}): "
                f"give at most {min(out_f, in_f)}"
            )


def lora_a_value(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """A's initial value: PEFT's kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def adapter_input(x: Tensor, a: Tensor, drop: nn.Module, keys: Tensor | None) -> Tensor:
    """A dropout(x): the rank-r input of B, (b, s, r)."""
    return F.linear(drop(x, keys), a)


class Linear(nn.Linear):
    """nn.Linear whose forward takes the sample keys, with an optional adapter.

    Every Linear of a block is one of these, so a block calls each the same way with or
    without LoRA; `u` is an adapter input computed elsewhere (GPT-2's shared A)."""

    def __init__(self, in_f: int, out_f: int, bias: bool) -> None:
        super().__init__(in_f, out_f, bias=bias)
        self.scaling = 0.0
        self.lora_drop: KeyedDropout | None = None
        self.adapted = False  # it has an adapter (its B; its A too unless shared)
        self.holds_a = False  # it holds its own A (GPT-2's wk and wv use wq's)

    def add_adapter(self, spec: LoRASpec, layer: int, leaf: str) -> None:
        """Register A (unless shared) and B after the base parameters, on the same device."""
        like = self.weight
        self.adapted, self.holds_a = True, spec.has_a(leaf)
        if self.holds_a:
            self.lora_a = nn.Parameter(like.new_empty(spec.rank, self.in_features))
        self.lora_b = nn.Parameter(like.new_empty(self.out_features, spec.rank))
        self.scaling = spec.scaling
        self.lora_drop = KeyedDropout(spec.dropout, spec.site(layer, leaf))

    def adapter_input(self, x: Tensor, keys: Tensor | None) -> Tensor | None:
        """A dropout(x) when this layer holds an A, else None."""
        if not self.holds_a:
            return None
        return adapter_input(x, self.lora_a, self.lora_drop, keys)

    def forward(self, x: Tensor, keys: Tensor | None = None, u: Tensor | None = None) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (b, s, out)
        if not self.adapted:
            return y
        u = self.adapter_input(x, keys) if u is None else u  # (b, s, r)
        return y + self.scaling * F.linear(u, self.lora_b)


class Adapted(Protocol):
    """What merging needs of a ModelConfig (architecture.py imports this module, so it is
    named by what it offers)."""

    @property
    def lora(self) -> LoRASpec | None: ...
    @property
    def n_layers(self) -> int: ...


def merge_adapters(cfg: Adapted, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full single-process tensors (plait names), base and adapters -> the base names only,
    each targeted weight W + scaling * B @ A: the plain model that computes what the adapted
    one does (`plait export --format hf --merge`). GPT-2's wk and wv use wq's shared A.
    The product is formed in float64 and rounded once, so the merged weight is the nearest
    fp32 to the exact sum."""
    spec = cfg.lora
    out = {n: t for n, t in params.items() if n.rpartition(".")[2] not in ADAPTER_LEAVES}
    if spec is None:
        return out
    for layer in range(cfg.n_layers):
        for leaf in spec.leaves:
            site = f"blocks.{layer}.{leaf}"
            a = params[f"blocks.{layer}.{spec.a_of(leaf)}.lora_a"]
            delta = spec.scaling * (params[f"{site}.lora_b"].double() @ a.double())  # (out, in)
            weight = params[f"{site}.weight"]
            out[f"{site}.weight"] = (weight.double() + delta).to(weight.dtype)
    return out
