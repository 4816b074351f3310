"""A trained rank's parameters as whole tensors, for comparing with one process (no tests)."""

from __future__ import annotations

import torch

from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.train import Trainer


def whole_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stages, whole: ZeRO-3's dp shards gathered (the
    engine's `unsharded`) and tp shards gathered (`full_tensor`); copies, so the trainer
    may go on or close."""
    specs = param_shard_specs(trainer.model)
    with trainer.engine.unsharded():
        return {
            n: full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach().clone()
            for n, p in trainer.model.named_parameters()
        }
