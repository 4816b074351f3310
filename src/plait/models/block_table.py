"""The block's layers, declared once per architecture: one table row per norm and Linear.

A `LinearRow` names one Linear of a block by its module path ("attn.wq") with every fact
other code needs of it: its shape rule (output and input widths, from the config), its
tensor-parallel style (column: split by output features; row: split by input features),
whether its output is added to the residual stream (the init scales those by 1/sqrt(2 L)),
its `--lora-targets` word, its Hugging Face module path inside a block and which config
flags give it a bias. A `NormRow` names a norm and its Hugging Face module. The rows are in
registration order, the order `ModelContract.check` compares.

Everything else derives from the table, so a variant (a bias on q, k and v; a norm on q and
k; a fused Hugging Face projection) is a change here and in the module that computes it:

- the contract (models/declare.py): every parameter's shape, split dimension and partial
  flags, and the adapters, each split like its base weight (`declare.adapter_params`);
- the model (models/transformer.py) builds each Linear from its row;
- the init (models/init.py): `residual` rows are scaled;
- LoRA (models/lora.py): the target words, PEFT's defaults, and the rows that share one A
  (rows stacked in one Hugging Face module, GPT-2's c_attn: PEFT adapts the module once);
- tensor parallelism (parallel/tp/apply.py): each row's style, and the sublayers whose
  input enters the tensor-parallel region (those holding a column-parallel row);
- the Hugging Face map (models/hf/mapping.py): names, and offsets in a fused module derived
  by stacking its rows in order; PEFT's target_modules (models/hf/peft.py);
- the estimator (models/architecture.py widths, estimate/adapters.py): which Linears read
  the block's normed inputs and which sum over tensor parallelism.

This module imports nothing of plait: the config reaches it as a `Shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal, Protocol

Style = Literal["column", "row"]
Width = Literal["h", "q", "kv", "f"]  # d_model, heads x head_dim, kv heads x head_dim, ffn
COUNTS = {2: "both", 3: "all three", 4: "all four"}  # how a message asks for every one


class Shape(Protocol):
    """What a row's rules read of a ModelConfig (architecture.py imports this module)."""

    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def arch(self) -> str: ...
    @property
    def bias(self) -> bool: ...


def width(cfg: Shape, rule: Width) -> int:
    """The number of features a width rule names for `cfg`."""
    if rule == "h":
        return cfg.d_model
    if rule == "q":
        return cfg.n_heads * cfg.head_dim
    if rule == "kv":
        return cfg.kv_heads * cfg.head_dim
    return cfg.ffn_dim


def flags(cfg: Shape) -> dict[str, bool]:
    """The config's switches a row's `bias` may name; "always": the family's own bias
    (Qwen2's q, k and v), whatever `model.bias` says."""
    return {"bias": cfg.bias, "always": True}


@dataclass(frozen=True)
class LinearRow:
    """One Linear of a block; see the module docstring."""

    path: str  # its module path in a block: "attn.wq"
    out: Width  # output features
    inp: Width  # input features
    style: Style  # tensor parallelism: column (by output) or row (by input)
    residual: bool  # its output joins the residual stream (init std / sqrt(2 L))
    target: str  # the --lora-targets word: "q"
    hf: str  # the Hugging Face module in a block: "self_attn.q_proj"
    bias: tuple[str, ...] = ("bias",)  # config flags any of which gives it a bias

    @property
    def sublayer(self) -> str:
        """The block's sublayer holding it ("attn", "mlp")."""
        return self.path.partition(".")[0]

    def widths(self, cfg: Shape) -> tuple[int, int]:
        """(out, in) features."""
        return width(cfg, self.out), width(cfg, self.inp)

    def has_bias(self, cfg: Shape) -> bool:
        switches = flags(cfg)
        return any(switches[flag] for flag in self.bias)


@dataclass(frozen=True)
class NormRow:
    """One norm of a block: its module path and its Hugging Face module. `over="head"`: an
    RMSNorm over each head of the projection it follows (Qwen3's q_norm and k_norm, before
    RoPE), of head_dim features; under tensor parallelism a rank normalizes its own heads,
    so the gain is replicated and its gradient partial over tp."""

    path: str  # "attn_norm"
    hf: str  # "input_layernorm"
    over: Literal["h", "head"] = "h"  # the residual stream's d_model, or each head

    def width(self, cfg: Shape) -> int:
        return cfg.head_dim if self.over == "head" else cfg.d_model


@dataclass(frozen=True)
class BlockTable:
    """One architecture's block: its rows in registration order, and how Hugging Face
    stores it."""

    name: str  # what messages call it: "LLaMA", "GPT-2"
    mlp: str  # the model.mlp its rows compute: "swiglu", "gelu"
    rows: tuple[NormRow | LinearRow, ...]
    hf_transposed: bool  # Hugging Face stores the Linears (in, out) (GPT-2's Conv1D)
    default_targets: tuple[str, ...]  # PEFT's default target_modules, as target words

    @cached_property
    def linears(self) -> tuple[LinearRow, ...]:
        return tuple(r for r in self.rows if isinstance(r, LinearRow))

    @cached_property
    def norms(self) -> tuple[NormRow, ...]:
        return tuple(r for r in self.rows if isinstance(r, NormRow))

    def linear(self, path: str) -> LinearRow:
        return next(r for r in self.linears if r.path == path)

    @cached_property
    def targets(self) -> dict[str, str]:
        """--lora-targets word -> the Linear's path, in registration order."""
        return {r.target: r.path for r in self.linears}

    def fused(self, path: str) -> tuple[LinearRow, ...]:
        """The rows stacked (in order) in the Hugging Face module of the row at `path`."""
        hf = self.linear(path).hf
        return tuple(r for r in self.linears if r.hf == hf)

    def hf_offset(self, path: str, cfg: Shape) -> int:
        """Where the row's output starts in its Hugging Face module's output: the widths of
        the rows stacked before it (GPT-2's c_attn is [q | k | v])."""
        rows = self.fused(path)
        before = rows[: [r.path for r in rows].index(path)]
        return sum(r.widths(cfg)[0] for r in before)

    def style(self, style: Style, sublayer: str | None = None) -> tuple[str, ...]:
        """Paths of the rows of `style` (in `sublayer` when given)."""
        return tuple(
            r.path for r in self.linears if r.style == style and sublayer in (None, r.sublayer)
        )


LLAMA = BlockTable(
    "LLaMA",
    "swiglu",
    (
        NormRow("attn_norm", "input_layernorm"),
        LinearRow("attn.wq", "q", "h", "column", False, "q", "self_attn.q_proj"),
        LinearRow("attn.wk", "kv", "h", "column", False, "k", "self_attn.k_proj"),
        LinearRow("attn.wv", "kv", "h", "column", False, "v", "self_attn.v_proj"),
        LinearRow("attn.wo", "h", "q", "row", True, "o", "self_attn.o_proj"),
        NormRow("mlp_norm", "post_attention_layernorm"),
        LinearRow("mlp.w_gate", "f", "h", "column", False, "gate", "mlp.gate_proj"),
        LinearRow("mlp.w_up", "f", "h", "column", False, "up", "mlp.up_proj"),
        LinearRow("mlp.w_down", "h", "f", "row", True, "down", "mlp.down_proj"),
    ),
    hf_transposed=False,
    default_targets=("q", "v"),  # PEFT's q_proj, v_proj
)

GPT2 = BlockTable(
    "GPT-2",
    "gelu",
    (
        NormRow("attn_norm", "ln_1"),
        LinearRow("attn.wq", "q", "h", "column", False, "q", "attn.c_attn"),
        LinearRow("attn.wk", "kv", "h", "column", False, "k", "attn.c_attn"),
        LinearRow("attn.wv", "kv", "h", "column", False, "v", "attn.c_attn"),
        LinearRow("attn.wo", "h", "q", "row", True, "o", "attn.c_proj"),
        NormRow("mlp_norm", "ln_2"),
        LinearRow("mlp.fc1", "f", "h", "column", False, "up", "mlp.c_fc"),
        LinearRow("mlp.fc2", "h", "f", "row", True, "down", "mlp.c_proj"),
    ),
    hf_transposed=True,  # Conv1D
    default_targets=("q", "k", "v"),  # PEFT's c_attn
)

QWEN3 = BlockTable(
    "Qwen3",
    "swiglu",
    (
        *LLAMA.rows[:5],
        NormRow("attn.q_norm", "self_attn.q_norm", over="head"),
        NormRow("attn.k_norm", "self_attn.k_norm", over="head"),
        *LLAMA.rows[5:],
    ),
    hf_transposed=False,
    default_targets=("q", "v"),
)
"""LLaMA's block with an RMSNorm over each head of q and of k before RoPE; registered after
o_proj, as Hugging Face's Qwen3Attention does."""

QWEN2 = BlockTable(
    "Qwen2",
    "swiglu",
    (
        LLAMA.rows[0],
        *(replace(r, bias=("always",)) for r in LLAMA.rows[1:4]),
        *LLAMA.rows[4:],
    ),
    hf_transposed=False,
    default_targets=("q", "v"),
)
"""LLaMA's block with biases on q, k and v (not o): Qwen2 and Qwen2.5."""

FUSED = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
         "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj",
         "mlp.up_proj": "mlp.gate_up_proj"}  # fmt: skip
PHI3 = BlockTable(
    "Phi-3",
    "swiglu",
    tuple(replace(r, hf=FUSED.get(r.hf, r.hf)) for r in LLAMA.rows),
    hf_transposed=False,
    default_targets=("q", "k", "v"),  # qkv_proj (PEFT has no default for Phi-3)
)
"""LLaMA's block, stored by Hugging Face with q, k and v stacked in one qkv_proj and gate
and up in one gate_up_proj (split on the way in, stacked on the way out, by the rows'
order); PEFT adapts each fused module once, so they share one A (models/lora.py)."""

MISTRAL = replace(LLAMA, name="Mistral")  # LLaMA's block; its attention slides (core_attention)

_ATTN, _MLP = LLAMA.linears[:4], LLAMA.linears[4:]
GEMMA2 = BlockTable(
    "Gemma 2",
    "geglu",
    (
        NormRow("attn_norm", "input_layernorm"),
        *_ATTN,
        NormRow("attn_post_norm", "post_attention_layernorm"),
        NormRow("mlp_norm", "pre_feedforward_layernorm"),
        *_MLP,
        NormRow("mlp_post_norm", "post_feedforward_layernorm"),
    ),
    hf_transposed=False,
    default_targets=("q", "v"),
)
"""LLaMA's Linears with a tanh-GELU gate, and a norm before and after each sublayer (the
block registers each post norm after its sublayer, models/transformer.py)."""

GEMMA3 = replace(
    GEMMA2,
    name="Gemma 3",
    rows=(
        *GEMMA2.rows[:5],
        NormRow("attn.q_norm", "self_attn.q_norm", over="head"),
        NormRow("attn.k_norm", "self_attn.k_norm", over="head"),
        *GEMMA2.rows[5:],
    ),
)
"""Gemma 2's block with Qwen3's per-head q and k norms (Gemma's (1 + w) kind)."""

TABLES = {
    "llama": LLAMA,
    "gpt2": GPT2,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "phi3": PHI3,
    "mistral": MISTRAL,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
}
"""Every architecture's table by its `model.family` name."""

LINEAR_PATHS = tuple(sorted({r.path for table in TABLES.values() for r in table.linears}))
"""Every architecture's Linear paths, sorted: an adapter's dropout site is its index here
(models/lora.py), so a path added later sorts among them and moves the sites after it."""


def table_for(arch: str) -> BlockTable:
    """The table of the architecture `arch` names (a config's `arch`: its `model.family`)."""
    return TABLES[arch]


def block_table(cfg: Shape) -> BlockTable:
    """The table of `cfg`'s architecture."""
    return table_for(cfg.arch)


def linear_widths(cfg: Shape) -> dict[str, tuple[int, int]]:
    """(out, in) features of each Linear of a block, by its path in the block."""
    return {r.path: r.widths(cfg) for r in block_table(cfg).linears}


def count_words(words: list[str]) -> str:
    """'q, k and v' of ['q', 'k', 'v']."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
