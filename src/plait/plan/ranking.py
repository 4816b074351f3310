"""`plait plan` output: the ranked layouts as a table, why each beats the next, the drops."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from plait.estimate.table import gib
from plait.plan.lora_base import base_line
from plait.plan.search import Dropped, Plan, Ranked, moves_base
from plait.plan.step_time import TERMS


def seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def why_better(a: Ranked, b: Ranked) -> str:
    """The term that makes `a` faster than `b` (the largest saving), or its memory."""
    gaps = {k: getattr(b.time, k) - getattr(a.time, k) for k in TERMS}
    term = max(gaps, key=lambda k: gaps[k])
    if moves_base(b.config) and not moves_base(a.config) and a.time.total >= b.time.total:
        return "within 1% of the next, and moves no LoRA base (the next gathers it)"
    if b.time.total - a.time.total <= 1e-9 * b.time.total or gaps[term] <= 0:
        return f"same time, {gib(b.memory - a.memory)} less memory"
    return f"{term} {seconds(gaps[term])} less than the next"


def plan_table(out: Plan, top: int) -> Table:
    req = out.request
    kept = f", {gib(out.headroom)} kept free" if out.headroom else ""
    table = Table(
        title=f"{req.preset} on {req.gpus} x {out.hardware.name} ({gib(out.memory)} each{kept}), "
        f"global batch {req.global_batch} x {req.seq_len} tokens",
        title_justify="left",
    )
    left = ("layout", "where the time goes", "why it beats the next")
    for col in ("#", "layout", "memory", "free", "step", "tokens/s", "MFU", *left[1:]):
        table.add_column(col, justify="left" if col in left else "right")
    shown = out.ranked[:top]
    for i, r in enumerate(shown):
        nxt = out.ranked[i + 1] if i + 1 < len(out.ranked) else None
        table.add_row(
            str(i + 1),
            r.candidate.describe(),
            gib(r.memory),
            free(r.memory, out.memory),
            seconds(r.time.total),
            f"{r.tokens_per_s():,.0f}",
            f"{r.mfu(out.hardware, req.gpus):.1%}",
            ", ".join(f"{k} {seconds(v)}" for k in TERMS if (v := getattr(r.time, k)) > 0),
            why_better(r, nxt) if nxt else "",
        )
    return table


def free(need: int, memory: int) -> str:
    """What a layout leaves unused on the device, in GiB and as a share of it: the headroom
    and whatever the layout does not need beyond it."""
    return f"{gib(memory - need)} ({(memory - need) / memory:.1%})"


def budget_words(out: Plan) -> str:
    """'80.000 GiB' or, with a headroom, '72.000 GiB (80.000 GiB less 8.000 GiB headroom)'."""
    if not out.headroom:
        return gib(out.memory)
    return f"{gib(out.budget)} ({gib(out.memory)} less {gib(out.headroom)} headroom)"


def dropped_line(d: Dropped, out: Plan) -> str:
    """A layout that does not fit: what it needs and how far it misses, the headroom counted."""
    room = f"the {gib(out.budget)} usable" if out.headroom else gib(out.memory)
    return (
        f"{d.candidate.describe()} needs {gib(d.need)} ({gib(d.need - out.budget)} more than "
        f"{room}; largest term {d.largest} {gib(d.largest_bytes)})"
    )


def wide_console() -> Console:
    """A terminal's own width; 160 columns when printing to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def print_plan(out: Plan, console: Console, top: int) -> None:
    console.print(plan_table(out, top))
    seen: set[tuple] = set()
    closest = []
    for d in out.dropped:  # closest to fitting first, one per cut
        if d.candidate.shape not in seen:
            seen.add(d.candidate.shape)
            closest.append(d)
    console.print(
        f"{out.considered:,} layouts considered; {len(out.ranked)} timed; "
        f"{len(out.dropped):,} do not fit in {budget_words(out)}"
        + (", the closest:" if closest else ".")
    )
    for d in closest[:5]:
        console.print("  " + dropped_line(d, out), highlight=False)
    line = base_line(out)  # a LoRA run: its base whole or sharded, and why
    if line:
        console.print(line, highlight=False, soft_wrap=True)
