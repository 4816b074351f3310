"""Other tools' published memory formulas, transcribed as formulas (nothing installed), so
docs/memory.md can put them next to plait's estimate and the measurement.

DeepSpeed, `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py; the `_all_cold` variants evaluate
them for every offload option from a parameter count alone). With Ψ parameters, G GPUs per
node, N nodes, T = G·N, the largest layer's Λ parameters and buffer factor 1.5:
  ZeRO-2, no offload:  GPU 4Ψ + 16Ψ/T
  ZeRO-2, CPU offload: GPU 2Ψ
  ZeRO-3, no offload:  GPU 4Λ + 18Ψ/T
  ZeRO-3, offload optimizer: GPU 4Λ + 2Ψ/T;   offload optimizer and parameters: GPU 4Λ
(their CPU figures, which size host memory for the whole node, are left out here).

Megatron-LM, `megatron/training/theoretical_memory_usage.py` (Korthikanti et al., 2022,
table 2): the most loaded shard holds (layer parameters / p + embedding) / t parameters at
18 bytes each (6 + 12/d with the distributed optimizer); activations, assuming sequence
parallelism and selective recomputation, are sbh(18 + 4f/h) per layer times L layers (the
first stage holds L/p layers for p micro-batches), plus 8sbp (token ids) and sbhp
(embedding dropout), plus, without a pipeline, 4sbh(1 + V/h) for the head and loss, all / t.
"""

from __future__ import annotations

from plait.config import Config
from plait.estimate.rank_params import padded_vocab, total_parameters


def deepspeed_zero2_gpu(psi: int, gpus: int, cpu_offload: bool) -> int:
    """DeepSpeed's ZeRO-2 model-state bytes per GPU."""
    return 2 * psi if cpu_offload else 4 * psi + int(16 * psi / gpus)


def deepspeed_zero3_gpu(psi: int, largest_layer: int, gpus: int, offload: str = "none") -> int:
    """DeepSpeed's ZeRO-3 model-state bytes per GPU; `offload` 'none', 'optimizer' or 'all'."""
    layer = 4 * largest_layer
    if offload == "all":
        return layer
    return layer + int((2 if offload == "optimizer" else 18) * psi / gpus)


def largest_layer(cfg: Config) -> int:
    """Λ: the most parameters one module holds directly (DeepSpeed's `model_to_params`):
    the embedding table or an MLP projection, whichever is larger."""
    m = cfg.model
    return max(m.vocab_size * m.d_model, m.ffn_dim * m.d_model + (m.ffn_dim if m.bias else 0))


def megatron_weights_and_optimizer(cfg: Config, distributed_optimizer: bool) -> float:
    """Megatron's bytes of weights and optimizer on the most loaded shard."""
    m, par = cfg.model, cfg.parallel
    embedding = m.d_model * padded_vocab(m, par.tp)
    tables = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    positions = m.max_seq_len * m.d_model if m.pos == "learned" else 0
    layers = total_parameters(m) - tables - positions  # blocks and the final norm
    shard = (layers / par.pp + embedding) / par.tp
    if not m.tie_embeddings and par.pp == 1:
        shard += embedding / par.tp
    per_param = 6 + 12 / par.dp if distributed_optimizer else 18
    return shard * per_param


def megatron_activations(cfg: Config) -> float:
    """Megatron's activation bytes on the first stage (SP and selective recompute assumed)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    s, b, h, p = t.seq_len, t.micro_batch, m.d_model, par.pp
    total = s * b * h * (18 + 4 * m.ffn_dim / h) * m.n_layers
    total += 8 * s * b * p + s * b * h * p
    if par.virtual_stages > 1:
        total *= 1 + (p - 1) / (p * par.virtual_stages)
    elif p > 1:
        total *= min(1, cfg.accumulation / p)
    if p == 1:
        total += 4 * s * b * h * (1 + padded_vocab(m, par.tp) / h)
    return total / par.tp
