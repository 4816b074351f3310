"""The configs lessons run: small models, few steps, the same data, fp32 unless the lesson is
about precision. Quick runs use tiny-gpt; the full run a model 7x larger and more steps."""

from __future__ import annotations

from typing import Any

from plait.config import Config, build_config
from plait.models.transformer import count_parameters


def lesson_config(
    quick: bool,
    parallel: dict[str, Any],
    train: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    micro: int = 2,
    accum: int = 1,
    data: dict[str, Any] | None = None,
) -> Config:
    """A validated config for one case: global batch = micro x accum x dp. `data`: the
    data section's overrides (an examples folder: the model follows its tokenizer)."""
    dp = parallel.get("dp", 1)
    over = {
        "model": dict(model or {}),
        "parallel": {"bucket_mb": 0.05, "comm_timeout": 120, **parallel},
        "data": {"max_bytes": 300_000, **(data or {})},
        "train": {
            "steps": 6 if quick else 20,
            "micro_batch": micro,
            "global_batch": micro * accum * dp,
            "seq_len": 32 if quick else 64,
            "warmup_steps": 2,
            "eval_every": 0,
            "progress": False,
            "device": "cpu",
            **(train or {}),
        },
    }
    cfg = build_config("tiny-gpt" if quick else "small-gpt", over)
    cfg.validate(check_data=False)
    return cfg


def psi(cfg: Config) -> int:
    """Ψ, the parameter count the formulas are written in."""
    return count_parameters(cfg.model)


def mib(n: float) -> float:
    return n / 2**20
