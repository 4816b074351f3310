"""The chosen layout as a TOML config that `plait train --config FILE` runs as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from plait.plan.search import Plan, Ranked


def plan_sections(r: Ranked) -> dict[str, dict[str, Any]]:
    """The [model] preset and every [parallel] and [train] field the layout sets."""
    cfg = r.config
    par = {k: v for k, v in vars(cfg.parallel).items() if v is not None}  # TOML has no null
    train = {k: getattr(cfg.train, k) for k in ("global_batch", "micro_batch", "seq_len")}
    model: dict[str, Any] = {"preset": cfg.preset}
    if cfg.model.lora_rank is not None:  # a LoRA plan: the adapters it was sized for
        m = cfg.model
        model |= {"lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha}
        model |= {"lora_dropout": m.lora_dropout}
        if m.lora_targets:  # '' is PEFT's default, which leaving the key out asks for
            model["lora_targets"] = m.lora_targets
    return {"model": model, "parallel": par, "train": train}


def write_plan(out: Plan, path: str | Path) -> None:
    """Write the best layout, with the prediction as comments."""
    best = out.ranked[0]
    head = (
        f"# plait plan: {best.candidate.describe()} on {out.request.gpus} x "
        f"{out.hardware.name}\n# predicted step {best.time.total:.4g} s, "
        f"{best.tokens_per_s():,.0f} tokens/s, {best.memory / 2**30:.2f} GiB per device\n"
    )
    Path(path).write_text(head + tomli_w.dumps(plan_sections(best)))
