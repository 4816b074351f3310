"""One decoder-only transformer that is GPT-2 or LLaMA depending on its ModelConfig.

Read top to bottom: norms, attention (rotary positions in rope.py), MLPs, the block, the
model, then counting. Each Linear of a block is built from its row of the block table
(models/block_table.py), which declares the block once for every other reader.

The model never knows how it is parallelized: tensor parallelism swaps its Linear layers, the
pipeline splits `blocks`, recomputation wraps `Block` or `CoreAttention`; each of them learns the
model's parts and parameters from its contract (`self.contract`, declared in models/declare.py) and
leaves a changed copy of it behind (`set_contract`). So head counts are read from tensor shapes at
run time (a tensor-parallel rank holds a subset of heads), and every dropout has a structural `site`
id that survives pipeline splitting.

Dropout keys: `keys` is an int64 tensor (b,) of per-sample keys (see dropout.py). It is
threaded through every forward so that masks depend on the sample, never on the rank.

Packed rows: `segments` (b, s) (see packing.py) become a `Packing` once per forward, whose
per-token positions feed the learned positions or RoPE and whose runs bound attention, by
the block-causal mask or by document (`packed_attention`); every layer gets the same object,
and the same additive mask tensor if any. Without segments nothing changes (is_causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table, linear_widths
from plait.models.contract import ModelContract
from plait.models.core_attention import CoreAttention
from plait.models.declare import describe
from plait.models.dropout import KeyedDropout
from plait.models.gemma import scale_embeddings, softcap
from plait.models.kv_cache import KVCache
from plait.models.light_loss import target_rows_loss
from plait.models.lora import Linear, LoRASpec
from plait.models.loss import LMLoss
from plait.models.norms import head_norms, make_norm
from plait.models.packing import Packing
from plait.models.rope import apply_rope, rope_cos_sin
from plait.torch_private import embedding_left_unset

# Dropout site ids: the embedding owns site 0, block i owns 4 * i + kind.
SITE_EMBED, SITE_ATTN_PROBS, SITE_ATTN_OUT, SITE_MLP_OUT = 0, 1, 2, 3


def make_linear(cfg: ModelConfig, path: str) -> Linear:
    """The Linear at `path` in a block, with the widths and bias its table row gives."""
    row = block_table(cfg).linear(path)
    out_f, in_f = row.widths(cfg)
    return Linear(in_f, out_f, row.has_bias(cfg))


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with optional RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim, self.layer = hd, layer
        self.rope = (cfg.theta(layer), cfg.rope_scaling) if cfg.pos == "rope" else None
        self.wq, self.wk = make_linear(cfg, "attn.wq"), make_linear(cfg, "attn.wk")
        self.wv, self.wo = make_linear(cfg, "attn.wv"), make_linear(cfg, "attn.wo")
        self.q_norm, self.k_norm = head_norms(cfg)  # Qwen3's and Gemma 3's, over each head
        site, window = 4 * layer + SITE_ATTN_PROBS, cfg.window(layer)
        self.core = CoreAttention(cfg.dropout, site, window, cfg.attn_scale, cfg.attn_softcap)
        self.shared_adapter = False  # GPT-2's LoRA: wk and wv use wq's A (models/lora.py)

    def forward(
        self,
        x: Tensor,
        keys: Tensor | None,
        cache: KVCache | None = None,
        pack: Packing | None = None,
    ) -> Tensor:
        b, s, _ = x.shape  # (b, s, h)
        start = cache.length if cache is not None else 0
        hd = self.head_dim
        # -1 heads: under tensor parallelism this rank's Linear yields only its heads.
        u = self.wq.adapter_input(x, keys) if self.shared_adapter else None  # (b, s, r)
        q = self.wq(x, keys, u).view(b, s, -1, hd).transpose(1, 2)  # (b, a, s, hd)
        k = self.wk(x, keys, u).view(b, s, -1, hd).transpose(1, 2)  # (b, kv, s, hd)
        v = self.wv(x, keys, u).view(b, s, -1, hd).transpose(1, 2)  # (b, kv, s, hd)
        if self.q_norm is not None:  # over each head's hd features, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            positions = None if pack is None else pack.positions
            theta, scaling = self.rope
            cos, sin = rope_cos_sin(s, hd, theta, x.device, start, positions, scaling)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(self.layer, k, v)  # (b, kv, start + s, hd)
        elif pack is not None:  # context parallel: every rank's keys (parallel/cp)
            k, v = pack.keys_values(k, v)  # (b, kv, s or the row's, hd)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:  # kv head j serves query heads j*rep .. j*rep + rep-1 (LLaMA's repeat_kv)
            k = k.repeat_interleave(rep, dim=1)  # (b, a, s, hd)
            v = v.repeat_interleave(rep, dim=1)  # (b, a, s, hd)
        if cache is None:
            window, explicit = self.core.window, self.core.explicit
            mask = None if pack is None else pack.bound(q, explicit, window)  # or by doc
            y = self.core(q, k, v, keys, mask)  # (b, a, s, hd)
        else:  # decoding (no dropout): the new positions see the cached ones
            y = self.core.decode(q, k, v, start)  # (b, a, s, hd)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, a*hd)
        return self.wo(y, keys)  # (b, s, h)


class GeluMLP(nn.Module):
    """GPT-2 MLP: fc2(gelu_tanh(fc1 x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = make_linear(cfg, "mlp.fc1"), make_linear(cfg, "mlp.fc2")

    def forward(self, x: Tensor, keys: Tensor | None = None) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x, keys), approximate="tanh"), keys)  # (b, s, h)


class SwiGLU(nn.Module):
    """LLaMA MLP: w_down(silu(w_gate x) * w_up x) (Shazeer, GLU variants, 2020); Gemma's
    gates with tanh-GELU instead (GeGLU, same paper)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate, self.w_up = make_linear(cfg, "mlp.w_gate"), make_linear(cfg, "mlp.w_up")
        self.w_down = make_linear(cfg, "mlp.w_down")
        self.shared_adapter = False  # Phi-3's LoRA: w_up uses w_gate's A (gate_up_proj)
        self.geglu = cfg.mlp == "geglu"

    def forward(self, x: Tensor, keys: Tensor | None = None) -> Tensor:
        u = self.w_gate.adapter_input(x, keys) if self.shared_adapter else None  # (b, s, r)
        gate = self.w_gate(x, keys, u)  # (b, s, f)
        act = F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)
        gated = act * self.w_up(x, keys, u)  # (b, s, f)
        return self.w_down(gated, keys)  # (b, s, h)


class Block(nn.Module):
    """Pre-norm residual block: x + drop(attn(norm x)), then x + drop(mlp(norm x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        self.attn_post_norm = make_norm(cfg) if cfg.gemma else None  # registered after attn
        self.attn_drop = KeyedDropout(cfg.dropout, 4 * layer + SITE_ATTN_OUT)
        self.mlp_norm = make_norm(cfg)
        self.mlp = GeluMLP(cfg) if cfg.mlp == "gelu" else SwiGLU(cfg)
        self.mlp_post_norm = make_norm(cfg) if cfg.gemma else None
        self.mlp_drop = KeyedDropout(cfg.dropout, 4 * layer + SITE_MLP_OUT)

    def forward(
        self,
        x: Tensor,
        keys: Tensor | None = None,
        cache: KVCache | None = None,
        pack: Packing | None = None,
    ) -> Tensor:
        y = self.attn(self.attn_norm(x), keys, cache, pack)  # (b, s, h)
        if self.attn_post_norm is not None:  # Gemma: each sublayer's output normed too
            y = self.attn_post_norm(y)
        x = x + self.attn_drop(y, keys)  # (b, s, h)
        y = self.mlp(self.mlp_norm(x), keys)  # (b, s, h)
        if self.mlp_post_norm is not None:
            y = self.mlp_post_norm(y)
        return x + self.mlp_drop(y, keys)  # (b, s, h)


def _table(rows: int, dim: int) -> nn.Embedding:
    """An embedding table; built on the meta device (`build/model.py build_model`, which fills every
    value after) it skips torch's random draw, whose first run on meta costs a second of
    imports. Elsewhere torch's own initialization stays (and its use of the global RNG)."""
    if torch.get_default_device().type == "meta":
        return embedding_left_unset(rows, dim)
    return nn.Embedding(rows, dim)


class Embedding(nn.Module):
    """Token embedding, plus learned positions for GPT-2 (per token in packed rows), then
    dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = _table(cfg.vocab_size, cfg.d_model)
        self.learned = cfg.pos == "learned"  # learned positions (GPT-2)
        self.scaled = cfg.gemma  # Gemma: times sqrt(d_model)
        if self.learned:
            self.pos = _table(cfg.max_seq_len, cfg.d_model)
        self.drop = KeyedDropout(cfg.dropout, SITE_EMBED)

    def forward(
        self,
        tokens: Tensor,
        keys: Tensor | None = None,
        start: int = 0,
        pack: Packing | None = None,
    ) -> Tensor:
        x = self.tok(tokens)  # (b, s, h)
        if self.scaled:
            x = scale_embeddings(x)
        if self.learned:
            end = start + tokens.shape[1]
            if end > self.pos.num_embeddings:
                raise ValueError(
                    f"sequence length {end} exceeds max_seq_len {self.pos.num_embeddings}"
                )
            if pack is None:
                x = x + self.pos(torch.arange(start, end, device=tokens.device))  # (b, s, h)
            else:  # packed rows: positions restart in every run
                x = x + self.pos(pack.positions)  # (b, s, h)
        return self.drop(x, keys)


class Head(nn.Linear):
    """The output projection, h -> V, no bias. `region_input` is the input as its matmul
    reads it: here the input itself; a tensor-parallel head (parallel/tp/layers.py) enters
    its region there (under sequence parallelism the all-gather of the sequence)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, bias=False)

    def region_input(self, x: Tensor) -> Tensor:
        return x


class Transformer(nn.Module):
    """embed -> blocks -> norm -> head; returns logits, or the loss given targets (models/loss.py:
    the mean over target tokens, or their sum / `denom`)."""

    contract: ModelContract  # what parallel code may know about this model (contract.py)
    packed_attention = "auto"  # how packed rows attend: the run's --packed-attention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.head: Head = Head(cfg)  # a tensor-parallel one has the same interface
        self.loss = LMLoss()
        add_adapters(self.blocks, cfg.lora)
        self.set_contract(describe(cfg))

    def set_contract(self, contract: ModelContract) -> None:
        """Adopt `contract`, the description of the model as a parallelizing function left it
        (`ModelContract.tensor_parallel`, `holding`, `recomputing`): tied weights are tied, the
        parameters checked against it (names, order, local shapes) and each one's `trainable`
        flag applied (a new tensor-parallel shard is born trainable)."""
        contract.tie(self)
        contract.check(self)
        self.contract = contract
        for entry, param in contract.bind(self):
            param.requires_grad_(entry.decl.trainable)

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        keys: Tensor | None = None,
        cache: KVCache | None = None,
        segments: Tensor | None = None,
        denom: float | None = None,
    ) -> Tensor:
        """`cache` (generation): `tokens` continue the cached positions, which it extends.
        `segments` (b, s): packed rows (packing.py); `denom`: the loss's divisor (loss.py)."""
        if cache is not None:  # generation: one process, the model's own modules
            return self._decode(tokens, cache)
        pack = Packing.of(segments, self.packed_attention)  # once: every layer reads it
        x = self.embed(tokens, keys, pack=pack)  # (b, s, h)
        for block in self.blocks:
            x = block(x, keys, None, pack)  # (b, s, h)
        return self.output(x, targets, denom)

    def _decode(self, tokens: Tensor, cache: KVCache) -> Tensor:
        """Logits of `tokens` at positions cache.length.., extending the cache."""
        x = self.embed(tokens, None, cache.length)  # (b, s, h)
        for block in self.blocks:
            x = block(x, None, cache)  # (b, s, h)
        cache.advance(tokens.shape[1])
        return self.output(x)

    def output(
        self, x: Tensor, targets: Tensor | None = None, denom: float | None = None
    ) -> Tensor:
        """Final norm and head: logits, or the loss given targets (the last stage's job).

        With targets and a head its contract declares one matmul (`ModelContract.plain_head`),
        only the rows that have a target reach the head, in chunks, and backward recomputes
        their logits (models/light_loss.py): the (b, s, V) logits are never held. The head's
        `region_input` comes first (a tensor-parallel head's sequence all-gather under SP)."""
        x, cap = self.norm(x), self.cfg.logit_softcap
        if targets is None:
            return softcap(self.head(x), cap)  # (b, s, V)
        if not self.contract.plain_head or cap is not None:  # Gemma 2: capped logits
            return self.loss(softcap(self.head(x), cap), targets, denom)
        x = self.head.region_input(x)  # (b, s, h)
        # A frozen head held in another dtype meets the activations in theirs, as its own
        # forward would (mixed_precision.compute_frozen_in); otherwise `to` is a no-op.
        weight, loss = self.head.weight.to(x.dtype), self.loss
        return target_rows_loss(x, weight, targets, loss.chunk_losses, loss.vocab, denom)


def add_adapters(blocks: nn.ModuleList, spec: LoRASpec | None) -> None:
    """Give each targeted Linear of every block its adapter (models/lora.py)."""
    for i, block in enumerate(blocks if spec is not None else ()):
        for leaf in spec.leaves:
            block.get_submodule(leaf).add_adapter(spec, i, leaf)
        block.attn.shared_adapter = "attn.wk" in spec.leaves and not spec.has_a("attn.wk")
        block.mlp.shared_adapter = "mlp.w_up" in spec.leaves and not spec.has_a("mlp.w_up")


# ---------------------------------------------------------------- counting


def count_parameters(cfg: ModelConfig, trainable: bool = False) -> int:
    """Unique parameters (a tied embedding counted once), from a model built on meta;
    `trainable`: only those the contract trains (a LoRA run's adapters)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def linear_weight_elements(cfg: ModelConfig) -> int:
    """Elements of every Linear weight (biases excluded), the head included."""
    return cfg.n_layers * _block_weight_elements(cfg) + cfg.d_model * cfg.vocab_size


def _block_weight_elements(cfg: ModelConfig) -> int:
    """Elements of a block's Linear weights (the block table's widths)."""
    return sum(out_f * in_f for out_f, in_f in linear_widths(cfg).values())


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """One block's forward matmul FLOPs per token: 2 per Linear weight element (multiply-add)
    plus attention's q k^T and probs v, 2·2·s·a·hd (h unless the head size is decoupled; no
    weights; the causal half is counted)."""
    return 2 * _block_weight_elements(cfg) + 4 * seq_len * cfg.n_heads * cfg.head_dim


def head_forward_flops_per_token(cfg: ModelConfig) -> int:
    """The output projection's forward FLOPs per token (embedding lookups are no matmuls)."""
    return 2 * cfg.d_model * cfg.vocab_size


def matmul_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 N + 12 L s h (Chowdhery et al., PaLM, 2022, appendix B).

    N counts every Linear weight including the head (embedding lookups are not matmuls);
    6 = 2 (multiply-add) x 3 (forward, and backward for activations and weights). The
    second term is attention's q k^T and probs v, which have no weights; with causal
    masking half of it is wasted work, and the convention counts it anyway. It is three
    forwards: 3 (L x layer_forward_flops_per_token + head_forward_flops_per_token).
    """
    attention = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim  # a·hd: h, or Qwen3's
    return 6 * linear_weight_elements(cfg) + attention
