"""QLoRA: the same LoRA over a bf16 base and over an NF4 base, under ZeRO-2 and ZeRO-3, and
recomputation with the NF4 base (bf16, dp ranks).

QLoRA (Dettmers et al., 2023) keeps LoRA's adapters and quantizes the frozen base's Linear
weights to 4-bit NormalFloat with double-quantized scales: 4.127 bits a weight instead of 16
(`--base-dtype nf4`, held in bitsandbytes' format), the embeddings, head and norms left in
bf16. The model states fall by the base's Linear weights times 2 - 0.516 bytes; under ZeRO-3
the base's gathers carry the packed bytes, about a quarter of bf16's. And QLoRA's own
observation, which the course quotes: with gradient checkpointing what one sequence keeps for
backward (and the gradient flowing back through it) outweighs all the LoRA weights together,
so a smaller rank saves little and adapters on every Linear cost little. The lesson measures
both sides and the rank at which they meet (on a tiny model a small one; at LLaMA-7B's size
with 512 tokens about 27).
"""

from __future__ import annotations

import math
from pathlib import Path

from plait.estimate import estimate
from plait.estimate.formulas import zero_model_state_bytes
from plait.estimate.frozen_base import base_total_bytes, frozen_base
from plait.estimate.model_states import ElementBytes
from plait.estimate.rank_params import rank_params, tp_contract
from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.readings import activations, bytes_by_op, median_step_s, model_states
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.models.declare import block_params, describe, is_adapter
from plait.schedule.stages import rank_plans

NAME = "qlora"
TITLE = "QLoRA: a bf16 base vs an NF4 base at the same LoRA, ZeRO-3's gathers, recompute"
RANK = 8
LORA = {"rank": RANK, "targets": "all"}  # [lora]
NF4 = {"base_dtype": "nf4"}
CASES = {  # label -> (options beyond dp and bf16, [lora] beyond the LoRA above)
    "lora-zero2": ({"zero": 2}, {}),
    "qlora-zero2": ({"zero": 2}, NF4),
    "lora-zero3": ({"zero": 3}, {}),
    "qlora-zero3": ({"zero": 3}, NF4),
    "qlora-recompute": ({"zero": 2, "recompute": "full"}, NF4),
}


def cases(quick: bool, procs: int) -> list[Case]:
    out = []
    for label, (options, base) in CASES.items():
        layout = {"dp": procs, "precision": "bf16", **options}
        out.append(Case(label, lesson_config(quick, layout, lora=LORA | base)))
    return out


def _phi(run: CaseRun) -> int:
    contract = describe(run.cfg.model)
    return sum(math.prod(e.decl.shape) for e in contract.params() if e.decl.trainable)


def _base_gathered(run: CaseRun) -> int:
    """Bytes the frozen base all-gathers per step under ZeRO-3 (estimate/frozen_base.py):
    2k x the padded base, in bytes (an NF4 block's fp group and its packed bytes)."""
    cfg = run.cfg
    plans = rank_plans(cfg.model.n_layers, 1, 1, 0, cfg.parallel.stage_layer_counts())
    params = rank_params(tp_contract(cfg.model, 1), plans)
    base = frozen_base(params, cfg, ElementBytes.of_run(cfg))
    return base.gathered_per_step(cfg.accumulation) * base.element


def _linear_sizes(run: CaseRun) -> int:
    """Σ (in + out) over a block's adapted Linears: an adapter of rank r there holds r x that."""
    return sum(sum(d.shape) for d in block_params(run.cfg.model)
               if len(d.shape) == 2 and not is_adapter(d.leaf))  # fmt: skip


def _memory_rows(runs: dict[str, CaseRun], sec: Section, phi: int) -> dict[str, int]:
    cfg = runs["lora-zero2"].cfg
    n, dp = psi(cfg) - phi, cfg.parallel.dp  # the base: Ψ counts the adapters too
    nf4 = base_total_bytes(runs["qlora-zero2"].cfg, ElementBytes.of("bf16", None), n)
    expected = {
        "lora-zero2": 2 * n + zero_model_state_bytes(2, phi, dp, 2, 2, 12),
        "qlora-zero2": nf4 + zero_model_state_bytes(2, phi, dp, 2, 2, 12),
    }
    formulas = {"lora-zero2": "2Ψ + 2Φ + 14Φ/N",
                "qlora-zero2": "NF4(Ψ_lin) + 2(Ψ - Ψ_lin) + 2Φ + 14Φ/N"}  # fmt: skip
    measured = {c: max(model_states(runs[c].records, r) for r in range(dp)) for c in expected}
    for case, formula in formulas.items():
        sec.rows.append(Row(f"{case}: model states per rank (largest)", formula,
                            expected[case], measured[case], exact=True))  # fmt: skip
    k = cfg.accumulation
    packed = "2kΦ x 2 B + 2k x (NF4 packed + fp rest), padded"
    for case, formula in (("lora-zero3", "(2kΦ + 2kΨ) x 2 B"), ("qlora-zero3", packed)):
        got = bytes_by_op(runs[case].records).get("all_gather", 0)
        want = 2 * 2 * k * phi + _base_gathered(runs[case])
        sec.rows.append(Row(f"{case}: all_gather per step", formula, want, got, exact=True))
    return measured


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    cfg = runs["qlora-recompute"].cfg
    phi = _phi(runs["lora-zero2"])
    n, dp, k = psi(cfg) - phi, cfg.parallel.dp, cfg.accumulation
    sec = Section(NAME, TITLE, __doc__.strip())
    measured = _memory_rows(runs, sec, phi)
    gathers = {
        c: bytes_by_op(runs[c].records).get("all_gather", 0) for c in ("lora-zero3", "qlora-zero3")
    }
    times = {c: median_step_s(r.records) for c, r in runs.items()}
    # QLoRA's observation: one sequence's saved bytes under recomputation vs all LoRA weights
    per_seq = activations(runs["qlora-recompute"].records, 0) / cfg.train.micro_batch
    est = estimate(cfg).ranks[0].line("activations").device / cfg.train.micro_batch
    weights = 2 * phi  # the adapters in bf16, as QLoRA counts them
    even = RANK * per_seq / weights  # the rank at which they would be equal
    sec.rows += [
        Row("qlora / lora model states (ZeRO-2)", "measured", None,
            measured["qlora-zero2"] / measured["lora-zero2"], unit="x"),
        Row("qlora / lora all_gather bytes (ZeRO-3)", "measured", None,
            gathers["qlora-zero3"] / gathers["lora-zero3"], unit="x"),
        Row("step time qlora / lora (ZeRO-2)", "measured", None,
            times["qlora-zero2"] / times["lora-zero2"], unit="x"),
        Row("qlora-recompute: saved bytes per sequence", "plait estimate", est, per_seq),
        Row("one sequence's saved bytes / all LoRA weights (Φ x 2 B)", "measured", None,
            per_seq / weights, unit="x"),
        Row("rank at which they are equal", "r x that ratio", None, even, unit="rank"),
    ]  # fmt: skip
    s, d, lin = cfg.train.seq_len, cfg.model.d_model, _linear_sizes(runs["lora-zero2"])
    sec.notes += [
        f"Ψ = {n:,} base parameters (the tiny model), Φ = {phi:,} adapter parameters (rank "
        f"{RANK}, every Linear of a block), N = {dp}, k = {k} micro-batches, bf16; the NF4 "
        "runs without --base-upcast (the base's rest in bf16).",
        f"Under full recomputation a sequence keeps each block's input, s x d x 2 B = "
        f"{s * d * 2:,} B a block (s = {s}, d = {d}), and the gradient flowing back through a "
        f"block is one such tensor; rank r on every Linear holds r x Σ(in + out) = r x {lin:,} "
        "weights a block. The blocks alone are equal at r = s·d/Σ(in + out) (here "
        f"{s * d / lin:.1f}; the measured rank above also counts the head's saves); for "
        "LLaMA-7B at 512 tokens 512 x 4096 / 78,080 = 27 (bf16 both): below it, a smaller rank "
        "saves less than one sequence's checkpoints, which is why QLoRA puts adapters on "
        "every Linear.",
    ]
    labels = list(CASES)[:4]
    states = {c: max(model_states(runs[c].records, r) for r in range(dp)) / 1e6 for c in labels}
    sec.figures.append(figures.bars(
        out / "qlora-model-states.png", ["ZeRO-2", "ZeRO-3"],
        {"bf16 base": [states["lora-zero2"], states["lora-zero3"]],
         "NF4 base": [states["qlora-zero2"], states["qlora-zero3"]]},
        f"model states per rank, same LoRA (Ψ = {n:,}, Φ = {phi:,}, N = {dp})", "MB"))  # fmt: skip
    sec.raw = {"psi": n, "phi": phi, "dp": dp, "model_states": measured, "all_gather": gathers,
               "saved_per_sequence": per_seq, "median_step_s": times}  # fmt: skip
    return sec
