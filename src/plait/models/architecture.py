"""The model's configuration: one decoder-only family covering GPT-2 and LLaMA (the layers of
each one's block are declared in models/block_table.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from plait.domain import above, at_least, check_fields, fraction
from plait.errors import ConfigError
from plait.models.block_table import TABLES, linear_widths
from plait.models.lora import LoRASpec, check_rank, lora_spec
from plait.models.rope import Llama3Scaling


@dataclass
class ModelConfig:
    """Shape and variant of the decoder-only transformer.

    GPT-2 is LayerNorm + GELU MLP + learned positions + tied embeddings + biases;
    LLaMA is RMSNorm + SwiGLU + RoPE + grouped-query attention + untied head, no biases.
    """

    family: str = field(
        default="",
        metadata={
            "help": "block architecture: " + ", ".join(TABLES) + "; default from mlp "
            "(swiglu: llama, gelu: gpt2)"
        },
    )
    vocab_size: int = field(
        default=256,
        metadata={"domain": at_least(1), "help": "vocabulary size (byte tokenizer: 256)"},
    )
    n_layers: int = field(
        default=4, metadata={"domain": at_least(1), "help": "number of transformer blocks"}
    )
    d_model: int = field(default=128, metadata={"domain": at_least(1), "help": "hidden size h"})
    n_heads: int = field(default=4, metadata={"domain": at_least(1), "help": "query heads a"})
    n_kv_heads: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "help": "key/value heads (grouped-query attention); default n_heads",
        },
    )
    head_size: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "help": "features per attention head; default d_model / n_heads (Qwen3 decouples it)",
        },
    )
    ffn_hidden: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "help": "MLP hidden size; default 4h (gelu) or 8h/3 rounded (swiglu)",
        },
    )
    max_seq_len: int = field(
        default=1024,
        metadata={"domain": at_least(1), "help": "longest sequence (learned positions)"},
    )
    norm: Literal["layernorm", "rmsnorm"] = field(
        default="layernorm", metadata={"help": "norm type"}
    )
    mlp: Literal["gelu", "swiglu", "geglu"] = field(
        default="gelu", metadata={"help": "MLP type (geglu: Gemma's tanh-GELU gated MLP)"}
    )
    pos: Literal["learned", "rope"] = field(
        default="learned", metadata={"help": "position encoding"}
    )
    tie_embeddings: bool = field(default=True, metadata={"help": "share input embedding and head"})
    bias: bool = field(default=True, metadata={"help": "biases in linear layers and norms"})
    dropout: float = field(
        default=0.0, metadata={"domain": fraction(), "help": "dropout probability (GPT-2 sites)"}
    )
    norm_eps: float = field(
        default=1e-5, metadata={"domain": above(0), "help": "epsilon of the norms"}
    )
    rope_theta: float = field(default=10000.0, metadata={"domain": above(0), "help": "RoPE base"})
    rope_factor: float | None = field(
        default=None,
        metadata={
            "domain": above(0),
            "help": "Llama 3 RoPE rescale: long wavelengths divided by it; default none (plain)",
        },
    )
    rope_low_freq_factor: float = field(
        default=1.0,
        metadata={"domain": above(0), "help": "Llama 3 RoPE: rescaled above original/this"},
    )
    rope_high_freq_factor: float = field(
        default=4.0, metadata={"domain": above(0), "help": "Llama 3 RoPE: kept below original/this"}
    )
    rope_original_max: int = field(
        default=8192,
        metadata={"domain": at_least(1), "help": "Llama 3 RoPE: the pretraining context"},
    )
    sliding_window: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "help": "a position attends to the last this many (itself included; Mistral v0.1, "
            "Gemma's local layers); default: to every earlier one",
        },
    )
    global_every: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "with sliding_window: every n-th layer attends to all (Gemma 2: 2, Gemma 3: "
            "6); 0: every layer slides",
        },
    )
    rope_local_theta: float | None = field(
        default=None,
        metadata={
            "domain": above(0),
            "help": "RoPE base of the sliding-window layers (Gemma 3: 10000); default rope_theta",
        },
    )
    attn_scalar: float | None = field(
        default=None,
        metadata={
            "domain": above(0),
            "help": "scores are q k^T / sqrt(this) (Gemma's query_pre_attn_scalar); default "
            "the head size",
        },
    )
    attn_softcap: float | None = field(
        default=None,
        metadata={"domain": above(0), "help": "scores soft-capped: tanh(s / c) c (Gemma 2: 50)"},
    )
    logit_softcap: float | None = field(
        default=None,
        metadata={"domain": above(0), "help": "logits soft-capped: tanh(z / c) c (Gemma 2: 30)"},
    )
    multiple_of: int = field(
        default=256,
        metadata={"domain": at_least(1), "help": "SwiGLU hidden size rounding (LLaMA convention)"},
    )
    init_std: float = field(
        default=0.02,
        metadata={"domain": at_least(0, float), "help": "std of the normal weight init"},
    )
    lora_rank: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "help": "LoRA rank r: freeze the base, train adapters (docs/lora.md); default off",
        },
    )
    lora_alpha: float = field(
        default=8.0,
        metadata={"domain": above(0), "help": "LoRA alpha: the update is scaled by alpha / r"},
    )
    lora_dropout: float = field(
        default=0.0, metadata={"domain": fraction(), "help": "dropout on the adapters' input"}
    )
    lora_targets: str = field(
        default="",
        metadata={
            "help": "LoRA targets: q,k,v,o,gate,up,down or attn, mlp, all; default PEFT's "
            "(LLaMA q,v; GPT-2 c_attn = q,k,v)"
        },
    )

    @property
    def lora(self) -> LoRASpec | None:
        """The adapters this model carries (None: no LoRA, every parameter trains)."""
        return lora_spec(
            self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets, self.arch
        )

    @property
    def arch(self) -> str:
        """The block architecture (its table in models/block_table.py): `family`, or the
        one `mlp` implies when no family is given (LLaMA's SwiGLU, GPT-2's GELU)."""
        return self.family or ("llama" if self.mlp == "swiglu" else "gpt2")

    def window(self, layer: int) -> int | None:
        """How many positions layer `layer` attends to (None: all): Hugging Face's
        `layer_types`, where layer i is global when (i + 1) % global_every == 0."""
        if self.sliding_window is None:
            return None
        if self.global_every and (layer + 1) % self.global_every == 0:
            return None
        return self.sliding_window

    @property
    def gemma(self) -> bool:
        """Gemma's block (2 or 3): norms scaling by (1 + w), a norm after each sublayer too,
        embeddings times sqrt(d_model) (models/gemma.py)."""
        return self.arch in ("gemma2", "gemma3")

    def theta(self, layer: int) -> float:
        """Layer `layer`'s RoPE base: Gemma 3's local base on its sliding layers."""
        local = self.rope_local_theta is not None and self.window(layer) is not None
        return self.rope_local_theta if local else self.rope_theta

    @property
    def attn_scale(self) -> float | None:
        """The factor of q k^T, None for 1/sqrt(head size) (attn_scalar's inverse root)."""
        return None if self.attn_scalar is None else self.attn_scalar**-0.5

    @property
    def rope_scaling(self) -> Llama3Scaling | None:
        """Llama 3's RoPE rescale when `rope_factor` is set (models/rope.py)."""
        if self.rope_factor is None:
            return None
        return Llama3Scaling(
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max,
        )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """`head_size`, or d_model / n_heads: q is n_heads x head_dim wide, o reads that back."""
        return self.head_size or self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """MLP hidden size; LLaMA's rule is int(2/3 * 4h) rounded up to `multiple_of`."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        """Raise ConfigError naming the values when the shape is impossible."""
        check_fields("model", self)  # each number in its domain (field metadata)
        if self.head_size is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}"
            )
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head dimension, got {self.head_dim}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"model.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.mlp not in ("gelu", "swiglu", "geglu"):
            raise ConfigError(f"model.mlp must be 'gelu', 'swiglu' or 'geglu', got {self.mlp!r}")
        if self.pos not in ("learned", "rope"):
            raise ConfigError(f"model.pos must be 'learned' or 'rope', got {self.pos!r}")
        self._check_family()
        if self.rope_factor is not None and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3's RoPE blend)"
            )
        spec = self.lora
        if spec is not None:
            check_rank(spec, linear_widths(self))

    def _check_family(self) -> None:
        """A family is one of the tables, and its rows compute the MLP `mlp` names."""
        if self.arch not in TABLES:
            raise ConfigError(
                f"model.family={self.family!r} is not one plait builds ({', '.join(TABLES)})"
            )
        if TABLES[self.arch].mlp != self.mlp:
            raise ConfigError(
                f"model.family={self.arch!r} has a {TABLES[self.arch].mlp} MLP, "
                f"got model.mlp={self.mlp!r}"
            )

    def check_seq_len(self, seq_len: int) -> None:
        """Learned positions end at max_seq_len (a Hugging Face GPT-2's n_positions): a longer
        sequence has no embedding. RoPE has no end (see `config.config_warnings`)."""
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        if self.pos == "learned" and seq_len > self.max_seq_len:
            raise ConfigError(
                f"seq_len {seq_len} exceeds the model's max_seq_len {self.max_seq_len} "
                f"(learned positions have no embedding past it); give --seq-len "
                f"{self.max_seq_len} or less"
            )
