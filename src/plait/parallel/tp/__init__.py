"""Tensor parallelism (Megatron style), one concern per module; import from the module.

mappings  the f/g autograd Functions: every tensor-parallel collective, and nothing else
sharding  ShardSpec: where a local shard sits in its full parameter (global shape, offsets)
layers    column- and row-parallel Linear, head/sequence-sharded dropout, the region entry
vocab     vocabulary-parallel embedding and cross-entropy (full logits never on one rank)
apply     the per-block plan and `apply_tensor_parallel`

The gradient rules tp adds (sequence-parallel sums, counting shards once in the norm) live
with the pipeline's in `plait.parallel.grads`; which tp sizes a model admits, in
`plait.composition`.
"""
