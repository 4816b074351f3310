"""ZeRO: data parallelism that shards optimizer states (stage 1), gradients (stage 2) and
parameters (stage 3) across the data-parallel ranks (Rajbhandari et al., 2020), with mixed
precision and CPU/NVMe offload. Stage 0 is plain data parallelism on the same engine: there
is one bucketed gradient reduction path in plait, `reducer.py`. Import from the modules.

Files, each one concern:
  layout.py         buckets, flat groups, padding, each rank's shard (pure arithmetic)
  flat_params.py    parameters as views of flat buffers; stage-3 gather/free/prefetch hooks
  reducer.py        gradient buckets: all-reduce or reduce-scatter, overlapped with backward
  master_states.py  master weights and moments on device or host; nvme.py: in files
  state_dict.py     optimizer state per parameter, for layout-independent checkpoints
  engine.py         ZeroEngine: the optimizer-engine surface that `plait.step` drives
The AdamW it steps is plait's one, `parallel/adamw.py`, shared with the engines that shard
nothing (`parallel/whole_adamw.py`, which keeps their state in `master_states.py`'s format).
"""
