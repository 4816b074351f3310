"""The published formulas the estimator reduces to, and the figures courses quote.

These are the closed forms (Ψ-level, no padding, no buckets); `estimate/` computes what
plait actually allocates and tests that it reduces to these where they apply.
"""

from __future__ import annotations


def zero_model_state_bytes(
    stage: int, psi: int, n: int, param_bytes: int, grad_bytes: int, optim_bytes: int
) -> float:
    """Per-rank model-state bytes of ZeRO `stage` (Rajbhandari et al., 2020, section 5).

    With Ψ parameters, N data-parallel ranks, P/G bytes per parameter and gradient element
    and K bytes of optimizer state per element (Adam: 8 for the moments, + 4 for fp32
    master weights under mixed precision):
      stage 0: (P+G+K)Ψ;  stage 1: (P+G)Ψ + KΨ/N;  stage 2: PΨ + (G+K)Ψ/N;  stage 3: (P+G+K)Ψ/N.
    Mixed-precision Adam (P=G=2, K=12): 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.
    """
    p, g, k = param_bytes * psi, grad_bytes * psi, optim_bytes * psi
    per_stage = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}
    if stage not in per_stage:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")
    return per_stage[stage]


def zero_comm_elements(stage: int, psi: int, accumulation: int = 1) -> dict[str, int]:
    """Logical elements per optimizer step of the gradient and parameter collectives.

    DP all-reduce Ψ; ZeRO-1/2 reduce-scatter Ψ + all-gather Ψ; ZeRO-3 all-gather 2Ψ +
    reduce-scatter Ψ (ZeRO paper, section 7). With gradient accumulation over k micro-batches,
    stages 2 and 3 keep no full gradient between micro-batches, so they reduce-scatter every
    micro-batch (kΨ), and stage 3 gathers the parameters for every forward and backward (2kΨ).
    """
    k = accumulation
    table = {
        0: {"all_reduce": psi},
        1: {"reduce_scatter": psi, "all_gather": psi},
        2: {"reduce_scatter": k * psi, "all_gather": psi},
        3: {"reduce_scatter": k * psi, "all_gather": 2 * k * psi},
    }
    if stage not in table:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage}")
    return table[stage]


def mixed_precision_adam_bytes(psi: int) -> int:
    """16Ψ: fp16/bf16 parameters and gradients (2Ψ + 2Ψ), fp32 master weights, momentum and
    variance (12Ψ), on one GPU (ZeRO paper, section 3.1). LLaMA-7B: 107,814,649,856 B."""
    return 16 * psi


def sixteen_bit_finetune_bytes(psi: int) -> int:
    """12Ψ: bf16 parameters and gradients (2Ψ + 2Ψ) and fp32 Adam moments (8Ψ), no fp32
    master copy: the figure behind QLoRA's "more than 780 GB" for LLaMA-65B."""
    return 12 * psi


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Activations of one transformer layer, 16-bit (Korthikanti et al., 2022, table 2):
    sbh(34 + 5as/h) with no parallelism; tensor parallel t: sbh(10 + 24/t + 5as/(ht));
    with sequence parallelism too: sbh(34 + 5as/h)/t."""
    sbh = s * b * h
    if sp:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def tp_comm_per_microbatch(
    n_layers: int, bsh: int, bs: int, sp: bool, first: bool = True, last: bool = True
) -> tuple[dict[tuple[str, str], tuple[int, int]], dict[tuple[str, str], tuple[int, int]]]:
    """Tensor-parallel collectives of one micro-batch on one rank, forward and backward:
    {(op, tag): (calls, logical elements)} with bsh = b·s·h and bs = b·s.

    Without sequence parallelism (Shoeybi et al., 2019): per layer 2 all-reduces forward (g
    after attention and MLP) and 2 backward (f before them); the vocab-parallel embedding
    adds one forward all-reduce (its g), the head one backward all-reduce (its f). With SP
    (Korthikanti et al., 2022) each all-reduce becomes an all-gather + reduce-scatter pair, of
    the same bsh logical elements, in both directions. The loss (on the last stage) exchanges
    per-token fp32 scalars: the max (bs) and the sums of exponentials and target logits (2bs).
    A pipeline rank holds `n_layers` blocks, the embedding if `first`, the head if `last`.
    """
    n = n_layers
    loss = {("all_reduce", "tp-loss"): (2, 3 * bs)} if last else {}
    if not sp:
        blocks = {("all_reduce", "tp"): (2 * n, 2 * n * bsh)} if n else {}
        fwd = {**blocks, **({("all_reduce", "tp-embed"): (1, bsh)} if first else {}), **loss}
        bwd = {**blocks, **({("all_reduce", "tp-head"): (1, bsh)} if last else {})}
        return fwd, bwd
    pair = ("all_gather", "reduce_scatter")
    blocks = {(op, "tp"): (2 * n, 2 * n * bsh) for op in pair} if n else {}
    fwd, bwd = dict(blocks), dict(blocks)
    if first:
        fwd[("reduce_scatter", "tp-embed")] = (1, bsh)
        bwd[("all_gather", "tp-embed")] = (1, bsh)
    if last:
        fwd[("all_gather", "tp-head")] = (1, bsh)
        bwd[("reduce_scatter", "tp-head")] = (1, bsh)
    return {**fwd, **loss}, bwd
