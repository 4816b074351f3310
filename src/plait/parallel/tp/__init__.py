"""Tensor parallelism (Megatron style), one concern per module.

mappings  the f/g autograd Functions: every tensor-parallel collective, and nothing else
sharding  ShardSpec: where a local shard sits in its full parameter (global shape, offsets)
layers    column- and row-parallel Linear, head/sequence-sharded dropout, the region entry
vocab     vocabulary-parallel embedding and cross-entropy (full logits never on one rank)
apply     the per-block plan and `apply_tensor_parallel`
grads     sequence-parallel gradient sync and the global gradient norm under tp

The public API is re-exported by `plait.parallel.tensor_parallel`.
"""
