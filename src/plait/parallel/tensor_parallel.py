"""Tensor parallelism (Megatron-LM) with sequence parallelism and a vocabulary-parallel loss.

The public API; the implementation is split by concern under `plait/parallel/tp/`
(mappings, sharding, layers, vocab, apply, grads). docs/tensor-parallel.md explains the
design and its costs. A trainer uses:

    check_tensor_parallel(cfg.model, tp, sequence_parallel, seq_len)   # before workers
    build_model(..., parallelize=lambda m: apply_tensor_parallel(m, mesh, comm, sp))
    loss = model(x, y, keys)            # the same loss on every tp rank; backward as usual
    sync_sequence_parallel_grads(model, comm)   # after the last backward (no-op without SP)
    norm = tp_grad_norm(model, comm)    # or grad_norm_groups(model) for own bookkeeping
"""

from __future__ import annotations

from plait.parallel.tp.apply import (
    apply_tensor_parallel,
    block_plan,
    check_tensor_parallel,
)
from plait.parallel.tp.grads import (
    clip_tp_grad_norm_,
    grad_norm_groups,
    sequence_parallel_partial_params,
    sync_sequence_parallel_grads,
    tp_grad_norm,
)
from plait.parallel.tp.layers import (
    ColumnParallelLinear,
    EnterRegion,
    RowParallelLinear,
    ShardedDropout,
)
from plait.parallel.tp.mappings import (
    CopyToTPRegion,
    GatherFromSequenceRegion,
    GatherFromTPRegion,
    ReduceFromTPRegion,
    ReduceScatterToSequenceRegion,
    ScatterToTPRegion,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from plait.parallel.tp.sharding import ShardSpec, full_tensor, param_shard_specs, split_spec
from plait.parallel.tp.vocab import (
    ParallelEmbedding,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_logits,
)

__all__ = [
    "ColumnParallelLinear",
    "CopyToTPRegion",
    "EnterRegion",
    "GatherFromSequenceRegion",
    "GatherFromTPRegion",
    "ParallelEmbedding",
    "ReduceFromTPRegion",
    "ReduceScatterToSequenceRegion",
    "RowParallelLinear",
    "ScatterToTPRegion",
    "ShardSpec",
    "ShardedDropout",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "block_plan",
    "check_tensor_parallel",
    "clip_tp_grad_norm_",
    "copy_to_tp",
    "full_tensor",
    "gather_from_sequence",
    "gather_from_tp",
    "gather_logits",
    "grad_norm_groups",
    "param_shard_specs",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_tp",
    "sequence_parallel_partial_params",
    "split_spec",
    "sync_sequence_parallel_grads",
    "tp_grad_norm",
]
