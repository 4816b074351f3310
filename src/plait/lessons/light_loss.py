"""The lighter loss on instruction data: saved activations with target rows only vs the full
logits (one micro-batch of packed instruction rows, fp32).

A plain last stage computes logits for every position and its loss keeps their fp32 softmax
for backward: b·s·V·4 bytes, the largest activation of a small model with a large vocabulary.
Instruction data's prompt tokens and pads have no target. plait's loss (models/light_loss.py)
runs the head and cross entropy only on the target rows, in chunks, and recomputes each
chunk's logits in backward: it keeps per target row only the head input, the row's index, its
target and a log-sum-exp. TRL reports 30-50% less peak memory for the same idea on
instruction data. Here both losses run on the same micro-batch and weights, metered.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plait.build.model import build_model
from plait.config import Config
from plait.data.sampler import replica_share, split_micro
from plait.estimate import activations as act
from plait.estimate import estimate
from plait.estimate.rank_params import padded_vocab
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.finetune_data import build_examples, step_indices, training_rows
from plait.lessons.measure import save_record
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.memory_tracker import MemoryTracker
from plait.mesh import Mesh
from plait.models.loss import IGNORE
from plait.models.packing import Packing
from plait.models.transformer import Transformer

NAME = "light-loss"
TITLE = "The lighter loss: saved activations with target rows only vs the full logits"
MICRO, SEQ = 4, 512  # four packed rows of 512 tokens: mostly prompts and pads
PATHS = ("full logits", "lighter loss")


def cases(quick: bool, procs: int, work: Path) -> list[Case]:
    """Builds instruction examples under `work` (quick: 100 examples, a 1,024-token BPE),
    then one world at dp `procs`: each rank meters its replica's first micro-batch."""
    data = build_examples(work / "data", 100 if quick else 2000, 1024 if quick else 4096)
    # Packed rows through the block-causal mask, whose one shared tensor the section's text
    # counts (by document, the default, there is none: docs/finetuning.md).
    par = {"dp": procs, "packed_attention": "mask"}
    cfg = lesson_config(quick, par, train={"seq_len": SEQ, "steps": 1},
                        model={"max_seq_len": SEQ, "dropout": 0.0}, micro=MICRO,
                        data={"path": str(data), "pack": True, "long": "drop"})  # fmt: skip
    return [Case("instruction", cfg, measure_both)]


def _full_logits(model: Transformer, tokens: Tensor, targets: Tensor, seg: Tensor | None) -> Tensor:
    """The plain computation the lighter loss replaced: the model's forward to the final
    norm, then logits for every position and the loss over them."""
    pack = Packing.of(seg, model.packed_attention)
    x = model.embed(tokens, None, pack=pack)
    for block in model.blocks:
        x = block(x, None, None, pack)
    return model.loss(model.head(model.norm(x)), targets, _denom(targets))


def _lighter(model: Transformer, tokens: Tensor, targets: Tensor, seg: Tensor | None) -> Tensor:
    return model(tokens, targets, None, segments=seg, denom=_denom(targets))


def _denom(targets: Tensor) -> float:
    """The micro-batch's target count, a number as a run passes it (the global batch's
    count, `loss.py`): the loss is then their mean, with no count tensor saved."""
    return float(max(1, int((targets != IGNORE).sum())))


def _metered(model: Transformer, loss_of, batch: tuple[Tensor, Tensor, Tensor | None]) -> dict:
    """Saved bytes (metered) and loss of one forward + backward, then the time of another
    (unmetered: the meter's hooks cost time; the first pass warmed it up)."""
    tracker = MemoryTracker()
    with tracker.activations():
        loss = loss_of(model, *batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_of(model, *batch).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {"saved": tracker.peak("activations"), "loss": loss.item(), "time_s": seconds}


def measure_both(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """This replica's first micro-batch through both losses on the same initial weights, as
    packed instruction rows and as text windows of the same tokens (every position a
    target, plain causal rows: what the estimator prices). Written as OUT/rank{r}.json."""
    rows = training_rows(cfg)[0]
    idx = step_indices(cfg, rows)[0]
    micro = split_micro(replica_share(idx, mesh.coord.dp, cfg.parallel.dp)[0], MICRO)[0]
    tokens, targets, seg = rows.draw(micro)
    text = (tokens, torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1), None)
    model = build_model(cfg.model, torch.device("cpu"), seed=cfg.train.seed)
    model.packed_attention = cfg.train.packed_attention
    out: dict[str, Any] = {"targets": int((targets != IGNORE).sum()), "positions": targets.numel()}
    for name, loss_of in zip(PATHS, (_full_logits, _lighter), strict=True):
        out[name] = _metered(model, loss_of, (tokens, targets, seg))
        out[f"text, {name}"] = _metered(model, loss_of, text)
    return save_record(cfg, mesh, [], **out)


def expected_saved(cfg: Config, targets: int) -> dict[str, int]:
    """Both paths' saved bytes from the estimator's terms: its activation line (every
    position a target) with the head's term swapped for the full logits', or with the
    target rows the micro-batch really has."""
    m = cfg.model
    x = act.MicroShape(cfg.train.micro_batch, cfg.train.seq_len, 1, False, 4)
    line = estimate(cfg).ranks[0].line("activations").device
    bound = act.head_bytes(m, x, padded_vocab(m, 1))
    return {
        "full logits": line - bound + act.full_logits_head_bytes(m, x, padded_vocab(m, 1)),
        "lighter loss": line - act.target_rows_bytes(m, x) + act.target_rows_bytes(m, x, targets),
    }


def text_config(cfg: Config) -> Config:
    """The run's config reading text windows: the estimator then prices plain causal rows
    (no mask, one set of positions), as the lesson's text-window passes run."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=None))


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    sec = Section(NAME, TITLE, __doc__.strip())
    run = runs["instruction"]
    rec = run.records[0]
    text = expected_saved(text_config(run.cfg), rec["positions"])  # every position a target
    for p in PATHS:
        formula = "plait estimate" if p == PATHS[1] else "plait estimate, full-logits head"
        sec.rows.append(Row(f"text windows, {p}: saved activations", formula, text[p],
                            rec[f"text, {p}"]["saved"], exact=True))  # fmt: skip
    expected = expected_saved(run.cfg, rec["targets"])
    measured = {p: rec[p]["saved"] for p in PATHS}
    sec.rows.append(Row("instruction rows: saved by the lighter loss",
                        "full-logits head - norm - target rows x (h·e + 20)",
                        expected[PATHS[0]] - expected[PATHS[1]],
                        measured[PATHS[0]] - measured[PATHS[1]], exact=True))  # fmt: skip
    for p in PATHS:
        what = f"instruction rows, {p}: saved activations"
        formula = "plait estimate" + ("" if p == PATHS[1] else ", full-logits head")
        sec.rows.append(Row(what, f"{formula}, the rows' targets", expected[p], measured[p],
                            exact=True))  # fmt: skip
    states = estimate(run.cfg).ranks[0].model_states()
    peak = {p: states + measured[p] for p in PATHS}
    sec.rows.append(
        Row(
            "instruction rows: saved activations, lighter / full logits",
            "measured",
            None,
            measured[PATHS[1]] / measured[PATHS[0]],
            unit="x",
        )
    )
    sec.rows.append(Row("instruction rows: model states + saved activations, lighter / full",
                        "TRL: 0.5-0.7 (30-50% less peak)", None,
                        peak[PATHS[1]] / peak[PATHS[0]], unit="x"))  # fmt: skip
    times = {p: max(r[p]["time_s"] for r in run.records) for p in PATHS}
    sec.rows.append(Row("instruction rows: forward + backward time, lighter / full logits",
                        "measured (backward recomputes the target rows' logits)", None,
                        times[PATHS[1]] / times[PATHS[0]], unit="x"))  # fmt: skip
    sec.notes.append(_note(run.cfg, rec, states, measured[PATHS[1]] - expected[PATHS[1]]))
    sec.figures.append(figures.bars(
        out / "light-loss.png", list(PATHS),
        {"saved activations": [measured[p] / 1e6 for p in PATHS],
         "model states": [states / 1e6 for _ in PATHS]},
        "one instruction micro-batch, per rank", "MB"))  # fmt: skip
    sec.raw = {"records": run.records, "expected": expected, "text": text, "model_states": states}
    return sec


def _note(cfg: Config, rec: dict[str, Any], states: int, gap: int) -> str:
    """The run's figures; `gap`: measured minus estimated saved bytes of the packed rows
    under the lighter loss (0 when the estimator prices packed rows as they run)."""
    m, t = cfg.model, cfg.train
    losses = ", ".join(f"{p} {rec[p]['loss']:.6f}" for p in PATHS)
    b, s = t.micro_batch, t.seq_len
    agree = "equal the estimate to the byte" if gap == 0 else f"differ by {gap:+,} B"
    return (
        f"Rank 0's micro-batch: {b} packed rows of {s} tokens, {rec['targets']:,} target "
        f"tokens of {rec['positions']:,} positions (the rest prompts and pads); V = "
        f"{m.vocab_size:,}, h = {m.d_model}; model states {states:,} B (fp32 Adam, the "
        f"estimate). Losses: {losses} (the sums over rows add in another order). The text "
        "windows are the same tokens as plain causal rows, every position a target: there "
        "both figures equal the formulas. On the packed rows both figures "
        f"{agree} given the rows' target count: the block-causal mask, b·s²·4 = "
        f"{b * s * s * 4:,} B, is one tensor every layer's attention saves (counted once; "
        "SDPA given the boolean mask made and saved a copy per layer), and the positions "
        "are per token. The meter counts what autograd saves; the full path also holds all "
        "logits for a moment in the forward, the lighter one chunk's."
    )
