"""LoRA: full fine-tuning vs adapters on a frozen base, ZeRO-2 vs ZeRO-3 with that base, and
recomputation under LoRA (bf16, ZeRO over dp).

Full fine-tuning holds 16Ψ of model states (ZeRO-2: 2Ψ + 14Ψ/N per rank). LoRA (Hu et al.,
2021) freezes the Ψ base parameters and trains Φ << Ψ adapter parameters: the base is held once
at its dtype (2Ψ in bf16) with no gradient, master weight or moment, and only the adapters
pay 16 bytes each (ZeRO-2: 2Φ + 14Φ/N). ZeRO-3 shards the frozen base too (2Ψ/N) but must
gather it for every forward and every backward of every micro-batch (2kΨ elements per step),
where ZeRO-2 gathers nothing of it: with a frozen base, stage 3 buys memory with the whole
base's traffic, which is why LoRA under ZeRO-3 is slow in the libraries users measured.
With the base frozen, activations are what remains (QLoRA's observation): recomputation
trades them for a second forward.
"""

from __future__ import annotations

import math
from pathlib import Path

from plait.estimate.formulas import zero_comm_elements, zero_model_state_bytes
from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.readings import activations, bytes_by_op, median_step_s, model_states
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.models.declare import describe

NAME = "lora"
TITLE = "LoRA: full fine-tuning vs adapters, ZeRO-2 vs ZeRO-3 with a frozen base, recompute"
LORA = {"rank": 8, "targets": "all"}
CASES = {  # label -> (layout options beyond dp and bf16, [lora] overrides)
    "full-zero2": ({"zero": 2}, {}),
    "lora-zero2": ({"zero": 2}, LORA),
    "lora-zero3": ({"zero": 3}, LORA),
    "lora-zero2-recompute": ({"zero": 2, "recompute": "full"}, LORA),
}


def cases(quick: bool, procs: int) -> list[Case]:
    return [
        Case(label, lesson_config(quick, {"dp": procs, "precision": "bf16", **par}, lora=lora))
        for label, (par, lora) in CASES.items()
    ]


def adapter_count(runs: dict[str, CaseRun]) -> int:
    """Φ: the trainable parameters the LoRA runs' contract declares."""
    contract = describe(runs["lora-zero2"].cfg.model)
    return sum(math.prod(e.decl.shape) for e in contract.params() if e.decl.trainable)


def _term(run: CaseRun, term: str) -> int:
    """Rank 0's bytes of one model-state term at the end of the last step."""
    return int(run.records[0]["steps"][-1]["memory"]["current"]["device"][term])


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    full = runs["full-zero2"].cfg
    n, dp, k = psi(full), full.parallel.dp, full.accumulation
    phi = adapter_count(runs)
    sec = Section(NAME, TITLE, __doc__.strip())
    expected = {
        "full-zero2": zero_model_state_bytes(2, n, dp, 2, 2, 12),
        "lora-zero2": 2 * n + zero_model_state_bytes(2, phi, dp, 2, 2, 12),
        "lora-zero3": 2 * n / dp + zero_model_state_bytes(3, phi, dp, 2, 2, 12),
    }
    formulas = {"full-zero2": "2Ψ + 14Ψ/N", "lora-zero2": "2Ψ + 2Φ + 14Φ/N",
                "lora-zero3": "2Ψ/N + 16Φ/N"}  # fmt: skip
    measured = {c: max(model_states(runs[c].records, r) for r in range(dp)) for c in expected}
    for case, formula in formulas.items():
        sec.rows.append(Row(f"{case}: model states per rank (largest)", formula,
                            expected[case], measured[case], exact=True))  # fmt: skip
    for case, count, sym in (("full-zero2", n, "Ψ"), ("lora-zero2", phi, "Φ")):
        got = bytes_by_op(runs[case].records)
        moved = got.get("reduce_scatter", 0) + got.get("all_gather", 0)
        elements = sum(zero_comm_elements(2, count, k).values())
        what, formula = f"{case}: gradient and parameter bytes per step", f"(k{sym} + {sym}) x 2 B"
        sec.rows.append(Row(what, formula, 2 * elements, moved, exact=True))
    gathers = {"lora-zero2": 2 * phi, "lora-zero3": 2 * (2 * k * phi + 2 * k * n)}
    for case, elements in gathers.items():
        got = bytes_by_op(runs[case].records).get("all_gather", 0)
        formula = "Φ x 2 B" if case == "lora-zero2" else "(2kΦ + 2kΨ) x 2 B"
        sec.rows.append(Row(f"{case}: all_gather per step", formula, elements, got, exact=True))
    times = {c: median_step_s(r.records) for c, r in runs.items()}
    sec.rows += [
        Row("step time LoRA / full (ZeRO-2)", "measured", None,
            times["lora-zero2"] / times["full-zero2"], unit="x"),
        Row("step time LoRA ZeRO-3 / ZeRO-2", "measured", None,
            times["lora-zero3"] / times["lora-zero2"], unit="x"),
        Row("step time LoRA recompute / none", "measured", None,
            times["lora-zero2-recompute"] / times["lora-zero2"], unit="x"),
    ]  # fmt: skip
    acts = {c: activations(runs[c].records, 0) for c in ("lora-zero2", "lora-zero2-recompute")}
    sec.rows += [
        Row("LoRA: activations / model states (no recompute)", "measured", None,
            acts["lora-zero2"] / measured["lora-zero2"], unit="x"),
        Row("LoRA: activations recompute / none", "measured", None,
            acts["lora-zero2-recompute"] / acts["lora-zero2"], unit="x"),
    ]  # fmt: skip
    sec.notes.append(
        f"Ψ = {n:,} base parameters (the tiny model), Φ = {phi:,} adapter parameters "
        f"(rank {LORA['rank']}, every Linear of a block), N = {dp}, k = {k} micro-batches."
    )
    sec.figures += _figures(runs, out, expected, measured, f"Ψ = {n:,}, Φ = {phi:,}, N = {dp}")
    sec.raw = {"psi": n, "phi": phi, "dp": dp, "model_states": measured,
               "activations": acts, "median_step_s": times}  # fmt: skip
    return sec


def _figures(
    runs: dict[str, CaseRun], out: Path, expected: dict, measured: dict, sizes: str
) -> list[Path]:
    """The model states by term, and formula vs measured per case."""
    terms = ("parameters", "gradients", "master_weights", "optimizer_states")
    by_term = {c: [_term(runs[c], t) / 1e6 for t in terms]
               for c in ("full-zero2", "lora-zero2", "lora-zero3")}  # fmt: skip
    labels = list(expected)
    return [
        figures.bars(out / "lora-terms.png", list(terms), by_term,
                     "model states per rank by term (LoRA: the frozen base is "
                     "in parameters)", "MB"),
        figures.bars(
            out / "lora-model-states.png", labels,
            {"formula": [expected[c] / 1e6 for c in labels],
             "measured": [measured[c] / 1e6 for c in labels]},
            f"model states per rank, {sizes}", "MB"),
    ]  # fmt: skip
