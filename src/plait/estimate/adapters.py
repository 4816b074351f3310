"""What a LoRA run saves for backward, block by block (docs/lora.md, docs/memory.md).

A frozen base changes what autograd keeps, not only what the optimizer holds: a frozen
Linear needs its weight (a parameter, not an activation) for the input's gradient but not
its input, since no weight gradient is computed; a frozen norm keeps no normalized copy for
its gain's gradient; and nothing before the first adapter needs a gradient at all, so the
frozen embedding and block 0 up to its first adapter save nothing. What the adapters add:
each A saves its input (the base Linear's input, or dropout(x) and the mask under
`lora_dropout`) and each B saves u = A x, r features per token (GPT-2's q, k, v share one
A and one u). A row-parallel target under tp sends u in the base's collective, so B saves a
view of that output: the whole (out + r)-feature storage. Symbols as in activations.py;
every rule below was read off the memory tracker's activation meter and is tested against
it (tests/test_lora_estimate.py).
"""

from __future__ import annotations

from plait.estimate.activations import MicroShape, core_bytes, rope_bytes, target_rows_bytes
from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.models.lora import LoRASpec


def frozen_norm_bytes(model: ModelConfig, x: MicroShape) -> int:
    """A norm with a frozen gain whose input needs a gradient: LayerNorm keeps input, mean
    and rstd as before; RMSNorm its fp32 input and 1/rms, no normalized copy."""
    if model.norm == "layernorm":
        return x.res(model) * x.e + 2 * x.rows() * x.e
    return x.res(model) * 4 + x.rows() * 4


def _read_by_a(
    spec: LoRASpec, leaves: list[str], n: int, x: MicroShape, grad: bool, kept: bool
) -> int:
    """What the A's of `leaves` (those holding one) save of their shared input of n
    elements: without adapter dropout the input itself, once, unless already `kept`;
    with it, each A its dropped copy and, when the input needs a gradient, the mask."""
    owners = [leaf for leaf in leaves if spec.has_a(leaf)]
    if not owners:
        return 0
    if spec.dropout == 0.0:
        return 0 if kept else n * x.e
    return len(owners) * (n * x.e + (n if grad else 0))


def _u_bytes(model: ModelConfig, spec: LoRASpec, leaves: list[str], x: MicroShape) -> int:
    """The u = A x each B saves: (b, s, r); a row-parallel target under tp saves its view of
    the collective's (out + r)-feature output (sequence-sharded under SP)."""
    total, rows = 0, block_table(model).style("row")
    for leaf in leaves:
        if not spec.has_a(leaf):
            continue  # GPT-2's k and v reuse q's u
        if leaf in rows and x.t > 1:
            total += x.rows() * (model.d_model + spec.rank) * x.e
        else:
            total += x.b * x.s * spec.rank * x.e
    return total


def lora_layer_bytes(model: ModelConfig, x: MicroShape, recompute: str, grad_in: bool) -> int:
    """Saved bytes of one block under LoRA; `grad_in`: whether its input needs a gradient
    (False only for the model's block 0, fed by the frozen embedding)."""
    if recompute == "full":
        return x.res(model) * x.e  # the checkpoint keeps the block's input either way
    spec, table = model.lora, block_table(model)
    assert spec is not None
    mine = list(spec.leaves)
    # the block table's Linears by what they read: the attention's normed input, its heads,
    # the MLP's normed input, its hidden features
    attn_in, attn_out = table.style("column", "attn"), table.style("row", "attn")
    mlp_in, mlp_out = table.style("column", "mlp"), table.style("row", "mlp")
    full, col = x.b * x.s * model.d_model, x.b * x.s * model.d_model // x.t
    mlp = x.b * x.s * model.ffn_dim // x.t
    # attention: norm, q/k/v (and their A), the core, the output projection
    qkv = [leaf for leaf in mine if leaf in attn_in]
    total = frozen_norm_bytes(model, x) if grad_in else 0
    total += _read_by_a(spec, qkv, full, x, grad_in, kept=False)
    attn_grad = grad_in or bool(qkv)
    # the fused kernel keeps its output, the output projection's input (a view of it)
    kept_out = attn_grad and recompute != "selective" and model.dropout == 0.0
    if attn_grad:
        total += 3 * col * x.e + core_bytes(model, x, recompute)
        total += rope_bytes(model, x)
    total += col * x.e if kept_out else 0
    wo = [leaf for leaf in mine if leaf in attn_out]
    total += _read_by_a(spec, wo, col, x, attn_grad, kept=kept_out)
    out_grad = attn_grad or bool(wo)
    total += x.res(model) if model.dropout > 0.0 and out_grad else 0  # its dropout mask
    # MLP: norm, the input projections (and their A), the activation, the down projection
    ins = [leaf for leaf in mine if leaf in mlp_in]
    total += frozen_norm_bytes(model, x) if out_grad else 0
    total += _read_by_a(spec, ins, full, x, out_grad, kept=False)
    total += _mlp_bytes(model, mine, mlp, x, out_grad)
    down = [leaf for leaf in mine if leaf in mlp_out]
    mlp_grad = out_grad or bool(ins) or bool(down)
    total += _read_by_a(spec, down, mlp, x, out_grad or bool(ins), kept=False)
    total += x.res(model) if model.dropout > 0.0 and mlp_grad else 0  # its dropout mask
    return total + _u_bytes(model, spec, mine, x)


def down_input_bytes(model: ModelConfig, x: MicroShape) -> int:
    """The MLP down projection's input its adapter's A saves (F·e; 0 when it is no
    target): freed by the first nodes of a block's backward, before the frozen product's
    input gradient runs (`estimate/peak.py` sets an NF4 base's dequantized weight against it)."""
    spec = model.lora
    if spec is None or not set(spec.leaves) & set(block_table(model).style("row", "mlp")):
        return 0
    return x.b * x.s * model.ffn_dim // x.t * x.e


def _mlp_bytes(model: ModelConfig, mine: list[str], f: int, x: MicroShape, grad: bool) -> int:
    """The MLP's own saved tensors between its projections (F = f elements each): SwiGLU's
    gate output (for silu), silu(gate) and up (for the product) when each needs a gradient;
    GELU's input when fc1's output needs one."""
    targets = block_table(model).targets
    if model.mlp == "gelu":
        return f * x.e if grad or targets["up"] in mine else 0
    gate, up = grad or targets["gate"] in mine, grad or targets["up"] in mine
    return f * x.e * ((2 if gate else 0) + (1 if up else 0))


def lora_head_bytes(model: ModelConfig, x: MicroShape, vocab_local: int) -> int:
    """The last stage under LoRA: the frozen final norm and the lighter loss's saves
    (`target_rows_bytes`: the selected head inputs, which its recomputing backward needs
    even with the head frozen, their indices and targets; no logits). (The frozen embedding
    of the first stage saves nothing: nothing before the first adapter needs a gradient.)"""
    return frozen_norm_bytes(model, x) + target_rows_bytes(model, x)
