"""Precision: fp32 vs bf16 vs fp16 (with a dynamic loss scale).

Mixed-precision Adam keeps as many model-state bytes as fp32 Adam: 16Ψ either way (fp32:
4Ψ weights + 4Ψ gradients + 8Ψ moments; 16-bit: 2Ψ + 2Ψ + 12Ψ with the fp32 master copy).
What 16 bits halve is the gradient traffic (2Ψ instead of 4Ψ per all-reduce), the
activations and, on hardware with 16-bit units, the time. fp16's narrow range needs a loss
scale: a step whose gradients overflow is skipped and the scale halved.
"""

from __future__ import annotations

from pathlib import Path

from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.readings import bytes_by_op, losses, median_step_s, model_states
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "precision"
TITLE = "Precision: fp32 vs bf16 vs fp16 memory, loss curves and the fp16 loss scale"
PRECISIONS = ("fp32", "bf16", "fp16")
WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}


def cases(quick: bool, procs: int) -> list[Case]:
    return [Case(p, lesson_config(quick, {"dp": procs, "precision": p})) for p in PRECISIONS]


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    n = psi(runs["fp32"].cfg)
    sec = Section(NAME, TITLE, __doc__.strip())
    for name in PRECISIONS:
        rec, w = runs[name].records, WIDTH[name]
        states = "4Ψ + 4Ψ + 8Ψ" if w == 4 else "2Ψ + 2Ψ + 12Ψ"
        flag = name == "fp16"  # + the overflow flag every rank agrees on (4 B)
        extra = " + 4 B overflow flag" if flag else ""
        sec.rows += [
            Row(f"{name}: model states per rank", f"{states} = 16Ψ", 16 * n,
                model_states(rec, 0), exact=True),
            Row(f"{name}: gradient all-reduce per step", f"{w}Ψ + 4 B loss{extra}",
                w * n + 4 + 4 * flag,
                bytes_by_op(rec).get("all_reduce", 0), exact=True),
        ]  # fmt: skip
    fp32_loss = losses(runs["fp32"].records)[-1]
    for name in ("bf16", "fp16"):
        sec.rows.append(Row(f"{name}: last loss vs fp32's", "fp32's loss", fp32_loss,
                            losses(runs[name].records)[-1], unit="nats"))  # fmt: skip
        sec.rows.append(Row(f"step time {name} / fp32", "measured", None,
                            median_step_s(runs[name].records)
                            / median_step_s(runs["fp32"].records), unit="x"))  # fmt: skip
    steps = runs["fp16"].records[0]["steps"]
    scales = [s.get("loss_scale", 1.0) for s in steps]
    skipped = [i for i, s in enumerate(steps) if s.get("skipped")]
    sec.rows.append(Row("fp16: steps skipped (overflow)", "measured", None, len(skipped), ""))
    sec.notes.append(f"fp16 loss scale per step: {scales}; skipped steps: {skipped or 'none'}.")
    sec.figures.append(figures.lines(
        out / "precision-loss.png", {p: losses(runs[p].records) for p in PRECISIONS},
        "training loss per step", "loss (nats/token)"))  # fmt: skip
    title = f"fp16 dynamic loss scale (skipped steps: {skipped or 'none'})"
    scale_series = {"fp16 loss scale": scales}
    path = out / "precision-loss-scale.png"
    sec.figures.append(figures.lines(path, scale_series, title, "scale", log=True))
    sec.raw = {"psi": n, "loss_scale": scales, "skipped": skipped,
               "losses": {p: losses(runs[p].records) for p in PRECISIONS}}  # fmt: skip
    return sec
