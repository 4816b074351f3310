"""What data parallelism communicates, when, and how a stalled collective fails."""

from __future__ import annotations

import pytest
import torch

from plait.comm import Comm
from plait.errors import CommTimeoutError
from plait.mesh import build_mesh
from plait.topology import Layout
from plait.train import Trainer
from reference import corpus_for, small_config


def _one_step_traffic(accum: int, bucket_mb: float) -> dict:
    cfg = small_config(dp=2, accum=accum, bucket_mb=bucket_mb, steps=1)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    trainer.train_step()
    stats = trainer.comm.stats
    out = {
        "grad": stats.total(op="all_reduce", tag="grad", axis="dp"),
        "loss": stats.total(op="all_reduce", tag="loss"),
        "all_ops": sorted({r["op"] for r in stats.as_rows()}),
        "numel": sum(p.numel() for p in trainer.model.parameters()),
        "padding": sum(g.padding for g in trainer.engine.groups),
        "buckets": len(trainer.engine.groups),
        "launches": list(trainer.engine.grads.launch_log),
    }
    trainer.close()
    return out


@pytest.mark.parametrize("accum", [1, 4])
def test_step_all_reduces_exactly_the_gradients(world2, accum):
    r = world2.run(_one_step_traffic, accum=accum, bucket_mb=0.02)[0]
    calls, elements, nbytes = r["grad"]
    assert r["padding"] == 0  # stage 0 pads nothing (ZeRO pads buckets to a multiple of dp)
    assert elements == r["numel"] + r["padding"]
    assert nbytes == 4 * elements  # fp32
    # Accumulation communicates once per step: one all-reduce per bucket, not per micro-batch.
    assert calls == r["buckets"] > 1
    assert r["loss"] == (1, 1, 4)  # the logged loss: one fp32 scalar
    assert r["all_ops"] == ["all_reduce"]


def test_buckets_launch_during_backward_in_order(world2):
    """Every bucket's all-reduce starts inside backward (overlap), strictly in index order."""
    r = world2.run(_one_step_traffic, accum=2, bucket_mb=0.02)[0]
    assert [b for b, _ in r["launches"]] == list(range(r["buckets"]))
    assert {when for _, when in r["launches"]} == {"backward"}


def _stall(timeout_s: float) -> str:
    """Rank 0 enters an all-reduce that rank 1 never joins."""
    mesh = build_mesh(Layout(dp=2), torch.device("cpu"), timeout_s)
    comm = Comm(mesh)
    comm.stats.begin_step(7)
    if mesh.rank == 1:
        return ""
    with pytest.raises(CommTimeoutError) as info:
        comm.all_reduce(torch.ones(3), "dp")
    return str(info.value)


def test_stalled_collective_raises_naming_op_axis_step(world2):
    message = world2.run(_stall, 2.0)[0]
    assert "all_reduce on axis dp" in message
    assert "at step 7" in message
    assert "did not complete within 2s" in message


def _gather_scatter() -> list:
    mesh = build_mesh(Layout(dp=2), torch.device("cpu"), 60)
    comm = Comm(mesh)
    r = mesh.rank
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.tensor([r, r + 10.0]), "dp", tag="t")
    mine = torch.empty(2)
    comm.reduce_scatter(mine, torch.arange(4.0) * (r + 1), "dp", op="avg", tag="t")
    value = torch.tensor([float(r)])
    comm.broadcast(value, "dp", src=1)
    return [gathered.tolist(), mine.tolist(), value.item(), comm.stats.as_rows()]


def test_collectives_and_their_accounting(world2):
    r0, r1 = world2.run(_gather_scatter)
    assert r0[0] == r1[0] == [0.0, 10.0, 1.0, 11.0]
    assert r0[1] == [0.0, 1.5] and r1[1] == [3.0, 4.5]  # avg of x and 2x
    assert r0[2] == r1[2] == 1.0
    rows = {row["op"]: row for row in r0[3]}
    assert rows["all_gather"]["elements"] == 4  # the gathered (full) buffer
    assert rows["reduce_scatter"]["elements"] == 4  # the input before scattering
    assert rows["broadcast"]["bytes"] == 4


def _zero_grad_starts_from_zero() -> list[float]:
    """The engine's zero_grad must not leak gradients into the next step's buckets."""
    cfg = small_config(dp=2, steps=3)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    x, y = trainer.corpus.train.batch(torch.arange(2))
    norms = []
    for _ in range(3):
        trainer.model(x, y).backward()
        trainer.engine.finish()
        norms.append(float(torch.cat([g.flatten() for g in trainer.engine.grads.shards]).norm()))
        trainer.engine.zero_grad()  # no optimizer step: the same gradient every time
    trainer.close()
    return norms


def test_zero_grad_starts_from_zero(world2):
    norms = world2.run(_zero_grad_starts_from_zero)[0]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[1] == pytest.approx(norms[2])
