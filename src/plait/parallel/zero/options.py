"""ZeroOptions: everything about how a ZeroEngine holds and steps its model, in one record.

The engine is built from three things: the model it steps, the communicator, the optimizer,
and this record. A record rather than seventeen keyword parameters so that the trainer's
recipe (`plait/build.py`) says what it chose in one place, a test states only what it
changes (`ZeroOptions(stage=3)`), and `dataclasses.replace` derives one setting from another.
Frozen: the engine reads it once, at construction, and a change afterwards would be a
setting the engine never saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from plait.memory_tracker import MemoryTracker
from plait.mixed_precision import DynamicLossScaler, Precision, parse_precision
from plait.models.nf4.format import NF4Source
from plait.parallel.zero.layout import NVME_SUB_GROUP_MB
from plait.schedule.stages import StagePlan


@dataclass(frozen=True)
class ZeroOptions:
    """How a ZeroEngine shards, places and steps its model; the defaults are plain data
    parallelism in fp32 over the `dp` axis.

    `stage`: 0-3 (engine.py's docstring says what each shards). `precision`: a Precision or
    its name (mixed_precision.py). `offload`: none, cpu or nvme, with `offload_dir` for
    nvme, whose master weights and moments move in sub-groups of `sub_group_mb`.
    `bucket_mb`: the gradient buckets' size under stages 0-2. `axis`: the mesh axis the
    model is replicated over. `tracker`, `scaler`: a memory tracker and an fp16 loss scaler
    to use instead of the engine's own. `isolate`: parameters that get a flat group each
    (`layout.build_groups`: a pipeline's tied embeddings). `initial_value(p, rows=None)`:
    p's fp32 initial value (or its dim-0 rows [r0, r1)), for a model whose parameters are
    not materialized (stage 3 asks for its shard's rows only, and never holds more than one
    group's shard at a time). `base_dtype`: what the frozen parameters (a LoRA run's base)
    are held in; None: the precision's parameter dtype (zero/frozen.py). `nf4`: where the
    blocks' Linear weights come from in NF4, when the base is held so (zero/nf4_base.py).
    `plans`: the pipeline stages this rank runs (None: no pipeline);
    `reshard_after_forward`: stage 3's policy under one (default: keep the stage gathered
    through the step; always: regather per micro-batch)."""

    stage: int = 0
    precision: Precision | str = "fp32"
    offload: str = "none"
    offload_dir: str | Path | None = None
    bucket_mb: float = 25.0
    sub_group_mb: float = NVME_SUB_GROUP_MB
    axis: str = "dp"
    tracker: MemoryTracker | None = None
    scaler: DynamicLossScaler | None = None
    isolate: Sequence[nn.Parameter] = ()
    initial_value: Callable[..., Tensor] | None = None
    base_dtype: torch.dtype | None = None
    plans: Sequence[StagePlan] | None = None
    reshard_after_forward: str = "default"
    nf4: NF4Source | None = None

    def parsed_precision(self) -> Precision:
        """`precision` as a Precision (a name is parsed with its default reduce dtype)."""
        if isinstance(self.precision, str):
            return parse_precision(self.precision)
        return self.precision

    @property
    def keeps_gathered(self) -> bool:
        """Stage 3 under a pipeline: whether a stage stays gathered through the step."""
        return self.reshard_after_forward != "always"
