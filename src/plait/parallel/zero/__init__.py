"""ZeRO: data parallelism that shards optimizer states (stage 1), gradients (stage 2) and
parameters (stage 3) across the data-parallel ranks (Rajbhandari et al., 2020), with mixed
precision and CPU/NVMe offload. Stage 0 is plain data parallelism on the same engine: there
is one bucketed gradient reduction path in plait, `reducer.py`. Import from the modules.

How ZeRO-3 works here, in the order a step meets it: the trainable parameters are laid out
in flat groups, one per block and one *root* for the rest (embedding, final norm, head),
`layout.block_units`; each rank keeps only its 1/N slice of every group's buffer, of its
gradients and of its fp32 master and moments. Before a block's forward a hook all-gathers
the block's buffer into storage that exists only while it is used, prefetching the next
block (`flat_params.Gatherer`); after the forward the storage is freed, and gathered again
before the block's backward (the root: for the whole forward, and again from the start of
the backward). As each block's gradients are complete, a reduce-scatter leaves every rank
the sum of its own slice (`reducer.py`), after every micro-batch; the optimizer then updates
only that slice (`engine.py`, `master_states.py`), and the next forward's gathers bring the
updated values. Traffic per micro-batch: all-gather 2Ψ and reduce-scatter Ψ; model states
16Ψ/N (docs/zero.md measures both). Under a pipeline a rank runs many micro-batches through
its stages, and `pipeline_gather.py` decides when a stage's units are gathered and freed. A
LoRA run's frozen base gets groups of its own, gathered beside the adapters', never reduced
(`frozen.py`; an NF4 base: `nf4_base.py`, its ZeRO-3 shards `nf4_shards.py`).

Files, each one concern:
  layout.py         buckets, flat groups, padding, each rank's shard (pure arithmetic)
  flat_params.py    parameters as views of flat buffers; stage-3 gather/free/prefetch hooks
  pipeline_gather.py  stage 3 under a pipeline: keep a stage gathered, or regather per block
  frozen.py         a LoRA run's frozen base: its dtype, whole or sharded, cast per use
  nf4_base.py       a QLoRA base in NF4, this rank's tp slice; nf4_shards.py: stage 3's shards
  reducer.py        gradient buckets: all-reduce or reduce-scatter, overlapped with backward
  master_states.py  master weights and moments on device or host; nvme.py: in files
  state_dict.py     optimizer state per parameter, for layout-independent checkpoints
  engine.py         ZeroEngine: the optimizer-engine surface that `plait.step` drives
  options.py        ZeroOptions: the engine's settings (stage, precision, offload...), one record
The AdamW it steps is plait's one, `parallel/adamw.py`, shared with the engines that shard
nothing (`parallel/whole_adamw.py`, which keeps their state in `master_states.py`'s format).
"""
