"""The configs lessons run: small models, few steps, the same data, fp32 unless the lesson is
about precision. Quick runs use tiny-gpt; the full run a model 7x larger and more steps."""

from __future__ import annotations

import dataclasses
from typing import Any

from plait.config import SECTIONS, Config
from plait.models.transformer import count_parameters
from plait.preflight import configure

RUN_SECTIONS = ("parallel", "memory", "train", "optim", "checkpoint", "log")
"""The sections whose options a lesson names flat, as the flags do (no name is in two)."""


def placed(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each option in the section that declares it: `{"zero": 2, "lr": 1e-3}` ->
    `{"memory": {"zero": 2}, "optim": {"lr": 1e-3}}`."""
    home = {f.name: s for s in RUN_SECTIONS for f in dataclasses.fields(SECTIONS[s])}
    out: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        out.setdefault(home[name], {})[name] = value
    return out


def lesson_config(
    quick: bool,
    parallel: dict[str, Any],
    train: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    micro: int = 2,
    accum: int = 1,
    data: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
) -> Config:
    """A validated config for one case: global batch = micro x accum x dp. `parallel` and
    `train`: the layout's and the run's options, named flat (`placed` puts each in its
    section); `data`: the data section's overrides (an examples folder: the model follows
    its tokenizer); `lora`: the [lora] section's."""
    dp = parallel.get("dp", 1)
    run = {"bucket_mb": 0.05, "comm_timeout": 120, "steps": 6 if quick else 20,
           "micro_batch": micro, "global_batch": micro * accum * dp,
           "seq_len": 32 if quick else 64, "eval_every": 0, "device": "cpu",
           "warmup_steps": 2, "progress": False}  # fmt: skip
    over = placed(run | parallel | (train or {}))
    over |= {"model": dict(model or {}), "data": {"max_bytes": 300_000, **(data or {})}}
    over["lora"] = dict(lora or {})
    cfg = configure("tiny-gpt" if quick else "small-gpt", over)
    cfg.validate()
    return cfg


def psi(cfg: Config) -> int:
    """Ψ, the parameter count the formulas are written in."""
    return count_parameters(cfg.model)


def mib(n: float) -> float:
    return n / 2**20
