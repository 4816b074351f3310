"""Activation recomputation: none vs selective vs full, saved activations vs step time.

Backward needs what the forward computed; autograd keeps it (the activations) from the
forward until the backward that uses it. Recomputation keeps less and runs part of the
forward again in backward. Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h) bytes per
layer in 16 bits; selective recomputation drops the attention core's 5·a·s²·b (scores,
softmax, dropout: cheap to redo, quadratic in s), full keeps the block input 2·s·b·h alone.
The lesson model is fp32, where every 2-byte tensor doubles and the 1-byte dropout masks do
not: s·b·h·(66 + 9·a·s/h) per layer, plus what plait's block also saves (the causal mask
s², LayerNorm's mean and 1/std 16·b·s); selective 66·s·b·h + 16·b·s, full 4·s·b·h. The
math does not change: the recomputed forward is the same arithmetic, and plait's dropout is
keyed, so the losses are equal bit for bit.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import Config
from plait.estimate import estimate
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.readings import activations, losses, median_step_s
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "recompute"
TITLE = "Activation recomputation: none vs selective vs full, activation memory vs step time"
MODES = ("none", "selective", "full")
FORMULAS = {
    "none": "L·[sbh(66 + 9as/h) + s² + 16bs] + ends",
    "selective": "L·(66sbh + 16bs) + ends",
    "full": "L·4sbh + ends",
}
INDEX = 8  # bytes of one int64 dropout key


def cases(quick: bool, procs: int) -> list[Case]:
    """Dropout on (the attention scores are then materialized: what selective drops), the
    longest sequence the quick model takes, so the a·s/h term shows, and twice the usual
    steps: selective's extra time is small next to a shared machine's noise."""
    train = {"seq_len": 64 if quick else 128, "steps": 12 if quick else 40}
    return [
        Case(mode, lesson_config(quick, {"dp": procs, "recompute": mode}, train=train,
                                 model={"dropout": 0.1}))
        for mode in MODES
    ]  # fmt: skip


def layer_formula(cfg: Config, mode: str) -> int:
    """One layer's saved bytes by the fp32 formula of the module docstring (dropout > 0)."""
    m, t = cfg.model, cfg.train
    s, b, h, a = t.seq_len, t.micro_batch, m.d_model, m.n_heads
    if mode == "full":
        return 4 * s * b * h
    kept = 66 * s * b * h + 16 * b * s
    return kept if mode == "selective" else kept + 9 * a * s * s * b + s * s


def keys_bytes(cfg: Config) -> int:
    """What torch's checkpoint saves that the estimator leaves out: the micro-batch's dropout
    keys, an input of every checkpointed call (one storage: the step's keys on this rank)."""
    return INDEX * cfg.train.micro_batch * cfg.accumulation


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    sec = Section(NAME, TITLE, __doc__.strip())
    cfg = runs["none"].cfg
    measured = {m: max(activations(runs[m].records, r) for r in range(cfg.parallel.dp))
                for m in MODES}  # fmt: skip
    expected = {m: estimate(runs[m].cfg).ranks[0].line("activations").device for m in MODES}
    times = {m: median_step_s(runs[m].records) for m in MODES}
    for m in MODES:
        sec.rows.append(Row(f"{m}: saved activations per rank (peak)", FORMULAS[m],
                            expected[m], measured[m], exact=m == "none"))  # fmt: skip
    base = losses(runs["none"].records)
    for m in MODES[1:]:
        diff = max(abs(x - y) for x, y in zip(losses(runs[m].records), base, strict=True))
        sec.rows.append(Row(f"{m}: largest loss difference from none's, every step",
                            "0 (bitwise equal)", 0.0, diff, unit="nats", exact=True))  # fmt: skip
    for m in MODES[1:]:
        sec.rows.append(Row(f"step time {m} / none", "> 1 (expected slower)", None,
                            times[m] / times["none"], unit="x"))  # fmt: skip
    sec.notes += _notes(cfg)
    sec.figures.append(figures.points(
        out / "recompute-memory-time.png",
        {m: (times[m] * 1e3, measured[m] / 1e3) for m in MODES},
        f"saved activations vs step time ({cfg.model.n_layers} layers, s = {cfg.train.seq_len})",
        "median step time (ms)", "activations per rank (kB)",
        expected={m: (times[m] * 1e3, expected[m] / 1e3) for m in MODES}))  # fmt: skip
    sec.raw = {"measured": measured, "estimate": expected, "median_step_s": times,
               "layer_formula": {m: layer_formula(cfg, m) for m in MODES},
               "losses": {m: losses(runs[m].records) for m in MODES}}  # fmt: skip
    return sec


def _notes(cfg: Config) -> list[str]:
    m, t = cfg.model, cfg.train
    per_layer = ", ".join(f"{mode} {layer_formula(cfg, mode):,} B" for mode in MODES)
    return [
        f"Per layer here (s = {t.seq_len}, b = {t.micro_batch}, h = {m.d_model}, "
        f"a = {m.n_heads}, L = {m.n_layers}): {per_layer}; the ends (token ids, positions, "
        "embedding dropout, final norm, head, fp32 logits for the loss) are the same in "
        "every mode. The expected column is `plait estimate`'s activations for the config.",
        f"Selective and full measure {keys_bytes(cfg)} B more than the estimate: torch's "
        "checkpoint saves the dropout keys (8 B per sample of the step) as an input of "
        "every checkpointed call, once for all layers; the estimator leaves them out. That "
        "is the tolerance of those two rows.",
        "Step times are medians of the steps after the first, which alone ran under the "
        "activation meter (its hooks cost 3-20% of a step here, unevenly across modes).",
        "Selective costs more here than the few percent Korthikanti et al. report: the core "
        "it recomputes includes the attention dropout, whose keyed mask (a hash per element "
        "of the b·a·s² scores, what makes plait's dropout layout-independent) is a large "
        "share of a small model's CPU step.",
    ]
