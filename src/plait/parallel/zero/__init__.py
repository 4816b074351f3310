"""ZeRO: data parallelism that shards optimizer states (stage 1), gradients (stage 2) and
parameters (stage 3) across the data-parallel ranks (Rajbhandari et al., 2020), with mixed
precision and CPU/NVMe offload. Stage 0 is plain data parallelism on the same engine.

Files, each one concern:
  layout.py     flat groups, padding, each rank's shard (pure arithmetic)
  adamw.py      element-wise AdamW on flat fp32 slices
  params.py     parameters as views of flat buffers; stage-3 gather/free/prefetch hooks
  reducer.py    gradient buckets: all-reduce or reduce-scatter, overlapped with backward
  states.py     master weights and moments on device or host; nvme.py: in files
  state_dict.py optimizer state per parameter, for layout-independent checkpoints
  engine.py     ZeroEngine: the step protocol that ties them together
"""

from plait.parallel.zero.adamw import AdamW, ElementwiseOptimizer
from plait.parallel.zero.engine import STAGES, ZeroEngine, check_zero_options
from plait.parallel.zero.state_dict import ParamShardState, assemble
from plait.parallel.zero.states import OFFLOADS

__all__ = [
    "OFFLOADS",
    "STAGES",
    "AdamW",
    "ElementwiseOptimizer",
    "ParamShardState",
    "ZeroEngine",
    "assemble",
    "check_zero_options",
]
