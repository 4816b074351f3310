"""One family's tiny preset trained in a world's layout against one process (no tests):
full fine-tuning or LoRA on every Linear of its block, fp32 (tests/test_family_layouts.py)."""

from __future__ import annotations

import torch

from lora_parity import lora_config
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config
from whole_params import whole_params

PARAM_ATOL = 5e-5  # as test_pp_parity.py: Adam turns rounding-order differences into ~1e-6


def family_parity(preset: str, lora: bool, sp: bool = False, zero: int = 0, **layout) -> list:
    """Train 3 steps of `preset` in the world's layout (tp/pp/dp in `layout`, sequence
    parallelism `sp`, ZeRO stage `zero`), compare with one process; this rank's names."""
    make = lora_config if lora else small_config
    cfg = make(steps=3, preset=preset, **layout)
    cfg.parallel.sequence_parallel, cfg.memory.zero = sp, zero
    cfg.validate()
    corpus = corpus_for(cfg)
    trainer = Trainer(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60), corpus)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return sorted(params)
