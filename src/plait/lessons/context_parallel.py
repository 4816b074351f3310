"""Context parallelism: one long packed row on one rank and split over two (--cp 2), with
each exchange: the activations a rank saves, the bytes its attention exchanges, and TRL's
probe (change one token of document 1: which places' logits move).

Each cp rank holds s/cp tokens of the row (pieces r and 2cp−1−r of every document), so what
a transformer saves per token shrinks by cp; attention needs the other ranks' keys and
values. allgather gathers each layer's K and V (2·b·s·kv·hd elements, (cp−1)/cp of them
from the others) and reduce-scatters their gradients; ring passes them rank to rank and
merges by log-sum-exp. TRL measured that context parallelism without the packed rows' mask
moved every logit of the row when one token of document 1 changed; here only document 1's
may move.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plait.build.model import build_model
from plait.comm import Comm
from plait.config import Config
from plait.estimate import activations as act
from plait.estimate import estimate
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.measure import save_record
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.memory_tracker import MemoryTracker
from plait.mesh import Mesh
from plait.models.transformer import Transformer
from plait.parallel.cp.packing import ContextPacking

NAME = "context-parallel"
TITLE = "Context parallelism: one long packed row on one rank and over two"
SEQ, CP = 512, 2
DOCUMENTS = (200, 120, 150, 42)  # one packed row; document 1 is places 200..319
EXCHANGES = ("allgather", "ring")
TAGS = {"allgather": (("cp_kv",), ("cp_kv_grad",)),  # forward's tags, backward's
        "ring": (("cp_ring_kv",), ("cp_ring_back", "cp_ring_home"))}  # fmt: skip


def cases(quick: bool, procs: int) -> list[Case]:
    """One world of cp = 2 (the lesson compares one rank with two, whatever `procs`)."""
    cfg = lesson_config(quick, {"cp": CP}, train={"seq_len": SEQ, "steps": 1},
                        model={"max_seq_len": SEQ}, micro=1)  # fmt: skip
    return [Case("cp", cfg, measure_row)]


def _row(cfg: Config) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The packed row: tokens, targets (the next token, the row's last none), segments, and
    the tokens with document 1's first token changed (the probe)."""
    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, SEQ), generator=gen)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENTS)]).unsqueeze(0)
    targets = torch.cat([tokens[:, 1:], torch.full((1, 1), -100)], dim=1)
    changed = tokens.clone()
    changed[0, DOCUMENTS[0]] = (tokens[0, DOCUMENTS[0]] + 1) % cfg.model.vocab_size
    return tokens, targets, segments, changed


def _pass(model: Transformer, tokens: Tensor, targets: Tensor, seg, denom: float,
          exchange: str | None = None) -> dict:  # fmt: skip
    """Saved bytes (metered), loss and the exchange's bytes (`exchange`, from the comm layer's
    counts) of one forward and backward, then the time of another (unmetered: the meter's
    hooks cost time; the first pass warmed it up)."""
    tracker = MemoryTracker()
    if exchange is not None:
        seg.comm.stats.begin_step(0)
    with tracker.activations():
        loss = model(tokens, targets, segments=seg, denom=denom)
        loss.backward()
    model.zero_grad(set_to_none=True)
    sent = [sum(_sent(seg.comm, t) for t in phase) for phase in TAGS.get(exchange, ())]
    start = time.perf_counter()
    model(tokens, targets, segments=seg, denom=denom).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {"saved": tracker.peak("activations"), "loss": loss.item(), "time_s": seconds,
            "bytes": sent}  # fmt: skip


def _sent(comm: Comm, tag: str) -> int:
    """Bytes this rank gathered, reduce-scattered or sent under `tag` (receives left out)."""
    return comm.stats.total(tag=tag, axis="cp")[2] - comm.stats.total("recv", tag, "cp")[2]


@torch.no_grad()
def _moved(model: Transformer, a: Tensor, b: Tensor, seg) -> int:
    """How many of the rank's places have logits that differ at all between rows a and b."""
    return int((model(a, segments=seg) != model(b, segments=seg)).any(-1).sum())


def measure_row(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """On every rank: the whole row as one process runs it, then the rank's s/cp tokens
    under each exchange (comm counts per exchange). Written as OUT/rank{r}.json."""
    model = build_model(cfg.model, torch.device("cpu"), seed=cfg.train.seed)
    model.packed_attention = cfg.train.packed_attention
    tokens, targets, seg, changed = _row(cfg)
    denom = float((targets != -100).sum())
    out: dict[str, Any] = {"cp1": _pass(model, tokens, targets, seg, denom)}
    out["cp1"]["moved"] = _moved(model, tokens, changed, seg)
    comm = Comm(mesh)
    for exchange in EXCHANGES:
        pack = ContextPacking.shard(seg, (1, SEQ), comm, exchange)
        run = _pass(model, pack.take(tokens), pack.take(targets), pack, denom, exchange)
        run["targets"] = int((pack.take(targets) != -100).sum())
        run["moved"] = _moved(model, pack.take(tokens), pack.take(changed), pack)
        out[exchange] = run
    return save_record(cfg, mesh, [], **out)


def expected_bytes(cfg: Config) -> dict[str, list[int]]:
    """Each exchange's bytes per rank (fp32), forward and backward, over every layer: the
    all-gather's gathered buffer and its reduce-scatter, 2·b·s·kv·hd; the ring's sends,
    (cp−1) blocks of 2·b·(s/cp)·kv·hd forward, backward with their dK, dV, then dK, dV home."""
    m = cfg.model
    kv = (m.n_kv_heads or m.n_heads) * m.head_dim
    layer = 2 * SEQ * kv * 4  # K and V of the whole row, bytes
    block = layer // CP
    return {
        "allgather": [m.n_layers * layer, m.n_layers * layer],
        "ring": [m.n_layers * block * (CP - 1), m.n_layers * block * (2 * (CP - 1) + 1)],
    }


def expected_saved(cfg: Config, exchange: str, targets: int) -> int:
    """The estimator's saved activations of a cp rank (every place a target, as it prices
    rows), less the target rows' term of the places this rank holds without a target."""
    par = dataclasses.replace(cfg.parallel, cp_exchange=exchange)
    line = estimate(dataclasses.replace(cfg, parallel=par)).ranks[0].line("activations").device
    return line - act.target_rows_bytes(cfg.model, _shape(cfg), SEQ // CP - targets)


def _shape(cfg: Config) -> act.MicroShape:
    return act.MicroShape(1, SEQ // CP, 1, False, 4)


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    sec = Section(NAME, TITLE, __doc__.strip())
    run = runs["cp"]
    recs, expected = run.records, expected_bytes(run.cfg)
    for exchange in EXCHANGES:
        for i, phase in enumerate(("forward", "backward")):
            formula = ("2·b·s·kv·hd·4 per layer" if exchange == "allgather"
                       else "ring sends per layer, 4 B each")  # fmt: skip
            sec.rows.append(Row(f"{exchange}: bytes per rank, {phase}", formula,
                                expected[exchange][i], recs[0][exchange]["bytes"][i],
                                exact=True))  # fmt: skip
    document, moved_one = DOCUMENTS[1], recs[0]["cp1"]["moved"]
    sec.rows.append(Row("probe, one rank: places moved by document 1's first token",
                        "document 1's length", document, moved_one, "places", True))  # fmt: skip
    for exchange in EXCHANGES:
        moved = sum(r[exchange]["moved"] for r in recs)
        sec.rows.append(Row(f"probe, cp 2 {exchange}: places moved over both ranks",
                            "document 1's length (TRL without the mask: the row's 512)",
                            document, moved, "places", True))  # fmt: skip
    for exchange in EXCHANGES:
        sec.rows.append(Row(f"{exchange}: saved activations, rank 0", "plait estimate --cp 2, "
                            "the rank's target rows", expected_saved(run.cfg, exchange,
                            recs[0][exchange]["targets"]), recs[0][exchange]["saved"],
                            exact=True))  # fmt: skip
    one = recs[0]["cp1"]
    for exchange in EXCHANGES:
        per_rank = max(r[exchange]["saved"] for r in recs)
        sec.rows.append(Row(f"{exchange}: saved activations per rank, cp 2 / one rank",
                            "1/cp per token; the gathered K, V whole", None,
                            per_rank / one["saved"], unit="x"))  # fmt: skip
        seconds = max(r[exchange]["time_s"] for r in recs)
        sec.rows.append(Row(f"{exchange}: forward + backward time, cp 2 / one rank",
                            "measured (one pass, a shared machine)", None,
                            seconds / one["time_s"], unit="x"))  # fmt: skip
    labels = ["one rank", *(f"cp 2, {e}" for e in EXCHANGES)]
    saved = [one["saved"], *(max(r[e]["saved"] for r in recs) for e in EXCHANGES)]
    sec.figures.append(figures.bars(
        out / "context-parallel.png", labels, {"saved activations per rank": [
            b / 1e6 for b in saved]}, f"one packed row of {SEQ} tokens", "MB"))  # fmt: skip
    sec.notes.append(_note(run.cfg, recs, saved))
    sec.raw = {"records": recs, "expected": expected}
    return sec


def _note(cfg: Config, recs: list[dict[str, Any]], saved: list[int]) -> str:
    m = cfg.model
    losses = ", ".join(f"{e} {sum(r[e]['loss'] for r in recs):.6f}" for e in EXCHANGES)
    return (
        f"{m.n_layers} layers, h = {m.d_model}, {m.n_heads} heads; one row of {SEQ} tokens "
        f"holding documents of {', '.join(map(str, DOCUMENTS))} tokens. Saved activations per "
        f"rank: one rank {saved[0]:,} B, cp 2 allgather {saved[1]:,} B, ring {saved[2]:,} B. "
        f"The loss of the row: one rank {recs[0]['cp1']['loss']:.6f}; cp 2 (the ranks' shares "
        f"summed) {losses}."
    )
