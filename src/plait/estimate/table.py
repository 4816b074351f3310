"""`plait estimate` output: a rich table per pipeline stage, or JSON for machines."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from plait.estimate.lines import PLACES, Estimate, RankEstimate


def gib(n: float) -> str:
    """Bytes as GiB for people (exact bytes are in --json)."""
    return f"{n / 2**30:,.3f} GiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB" if n else "-"


def rank_table(r: RankEstimate, pp: int) -> Table:
    layers = f"layers {r.layers[0]}-{r.layers[-1]}" if r.layers else "no layers"
    title = f"pipeline stage {r.pp_rank} of {pp} ({layers}), any dp/tp rank"
    table = Table(title=title, title_justify="left")
    for col in ("term", *PLACES, "formula"):
        table.add_column(col, justify="right" if col in PLACES else "left")
    for line in r.lines:
        table.add_row(line.name, *(gib(line.at(p)) for p in PLACES), line.formula)
    peak = r.peak_moment()
    alive = ", ".join(f"{t} {gib(b)}" for t, b in peak.terms if b)
    why = f"model states + what is alive at the peak ({peak.name}: {alive or 'nothing'})"
    totals = (gib(r.total(p)) for p in PLACES)
    table.add_row("total", *totals, why, style="bold")
    return table


def print_estimate(est: Estimate, console: Console) -> None:
    for r in est.ranks:
        console.print(rank_table(r, len(est.ranks)))
    ref = est.reference
    full = "Full fine-tuning, for comparison: " if "lora_phi" in ref else ""
    console.print(
        f"Ψ = {est.psi:,} parameters. {full}One GPU, mixed-precision Adam 16Ψ = "
        f"{ref['mixed_precision_adam_16psi']:,} B ({gib(ref['mixed_precision_adam_16psi'])}); "
        f"16-bit fine-tuning, no master copy, 12Ψ = {ref['bf16_finetune_12psi']:,} B "
        f"({gib(ref['bf16_finetune_12psi'])})."
    )
    zero = ", ".join(f"stage {s} {gib(ref[f'zero{s}_per_rank'])}" for s in range(4))
    what = "full fine-tuning's ZeRO" if full else "ZeRO"
    console.print(f"{what} closed forms per rank at this dp and precision (no tp/pp): {zero}.")
    if "lora_phi" in ref:
        frozen = ref["lora_one_gpu"] - ref["lora_bytes_per_adapter_param"] * ref["lora_phi"]
        console.print(
            f"LoRA: Φ = {ref['lora_phi']:,} adapter parameters ({ref['lora_phi'] / est.psi:.3%}"
            f" of Ψ, the base above) at {ref['lora_bytes_per_adapter_param']} B each; one GPU "
            f"holds the frozen base {gib(frozen)} + adapter states "
            f"{gib(ref['lora_one_gpu'] - frozen)} = {gib(ref['lora_one_gpu'])} before activations."
        )
    worst = est.most_loaded
    console.print(f"Most loaded: stage {worst.pp_rank}, {gib(worst.total())} on the device.")


def print_json(est: Estimate) -> None:
    print(json.dumps(est.to_dict(), indent=2))
