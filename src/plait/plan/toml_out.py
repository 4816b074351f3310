"""The chosen layout as a TOML config that `plait train --config FILE` runs as it is."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import tomli_w

from plait.config.layout_sections import MODEL_LORA
from plait.plan.search import Plan, Ranked


def plan_sections(r: Ranked) -> dict[str, dict[str, Any]]:
    """The [model] preset, every [parallel] and [memory] field, and the [train] fields the
    layout sets (batch, sequence, precision); a LoRA plan's [lora]."""
    cfg = r.config
    given = lambda section: {k: v for k, v in asdict(section).items() if v is not None}  # noqa: E731 (TOML has no null)
    keys = ("global_batch", "micro_batch", "seq_len", "precision", "reduce_dtype")
    train = {k: getattr(cfg.train, k) for k in keys if getattr(cfg.train, k) is not None}
    out = {"model": {"preset": cfg.preset}, "parallel": given(cfg.parallel)}
    out |= {"memory": given(cfg.memory), "train": train}
    if cfg.model.lora_rank is not None:  # a LoRA plan: the adapters it was sized for (the
        lora = {k: getattr(cfg.model, name) for k, name in MODEL_LORA.items()}  # model's)
        if not lora["targets"]:  # '' is PEFT's default, which leaving the key out asks for
            del lora["targets"]
        out["lora"] = lora | {"base_dtype": cfg.lora.base_dtype}
    return out


def write_plan(out: Plan, path: str | Path) -> None:
    """Write the best layout, with the prediction as comments."""
    best = out.ranked[0]
    head = (
        f"# plait plan: {best.candidate.describe()} on {out.request.gpus} x "
        f"{out.hardware.name}\n# predicted step {best.time.total:.4g} s, "
        f"{best.tokens_per_s():,.0f} tokens/s, {best.memory / 2**30:.2f} GiB per device\n"
    )
    Path(path).write_text(head + tomli_w.dumps(plan_sections(best)))
