"""The asynchronous PipeDream-2BW runtime: the delayed update, exactly; no flush; two versions.

2BW does not reproduce synchronous training, so its parity test is against a single-process
implementation of the same rule, written here as plainly as possible: keep W(k-1) and W(k),
take the gradient of step k's global-batch mean loss at W(k-1), clip it as the trainer does,
and apply AdamW to W(k). Loss every step (rtol 1e-5) and parameters after 10 steps must match
for pp in {2, 4}, pp2 x dp2 and pp2 x tp2 (with and without sequence parallelism), tied (GPT-2)
and untied (LLaMA) embeddings.
"""

from __future__ import annotations

import copy

import pytest
import torch

from plait.build.model import build_model
from plait.composition import check_two_bw
from plait.config import Config
from plait.data import GlobalBatchSampler, eval_indices
from plait.data.batches import Corpus
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.schedule.actions import Kind
from plait.schedule.schedules import two_bw
from plait.schedule.two_bw_points import check_cut, update_cut, update_points
from plait.train import Trainer
from reference import corpus_for, small_config

RTOL = 1e-5
PARAM_ATOL = 5e-5  # as test_pp_parity.py: Adam amplifies rounding-level gradient differences


def two_bw_config(**kw) -> Config:
    """small_config with schedule 2bw: validation still refuses 2bw for the synchronous
    trainer, so validate as 1f1b and switch afterwards."""
    cfg = small_config(schedule="1f1b", **kw)
    cfg.parallel.schedule = "2bw"
    return cfg


# -- the single-process reference of the delayed rule ---------------------------------------
def delayed_reference(cfg: Config, corpus: Corpus, steps: int):
    """W(k+1) = W(k) - lr_k·AdamW(clip(∇f(W(k-1); batch k))), W(-1) = W(0), whole batch.

    Returns per-step losses (at W(k-1)), gradient norms, final parameters by name, and the
    validation loss at W(steps).
    """
    t = cfg.train
    cur = build_model(cfg.model, torch.device("cpu"), t.seed)  # W(k)
    cur.packed_attention = "mask"  # packed rows: the dense mask is the reference
    prev = copy.deepcopy(cur)  # W(k-1)
    opt = build_optimizer(cur, cfg.optim)
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    losses, norms = [], []
    for k in range(steps):
        x, y, seg = corpus.train.draw(sampler.next_batch())  # any Rows
        loss = prev(x, y, sample_keys(t.seed, k, torch.arange(t.global_batch)), segments=seg)
        prev.zero_grad(set_to_none=True)
        loss.backward()
        for p_cur, p_prev in zip(cur.parameters(), prev.parameters(), strict=True):
            p_cur.grad = p_prev.grad
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(cur.parameters(), max_norm)))
        prev.load_state_dict(cur.state_dict())  # W(k) becomes the previous version
        set_lr(opt, lr_at(k, cfg.optim, t.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in cur.named_parameters()}
    cur.eval()
    with torch.no_grad():
        x, y, seg = corpus.val.draw(eval_indices(len(corpus.val), t.eval_batches * t.global_batch))
        val = float(cur(x, y, segments=seg))
    return losses, norms, params, val


def _parity(steps: int = 10, sequence_parallel: bool = False, **kw) -> dict:
    cfg = two_bw_config(steps=steps, **kw)
    cfg.parallel.sequence_parallel = sequence_parallel
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(steps)]
    val = trainer.evaluate()
    tp_ops = sorted({r["op"] for r in trainer.comm.stats.as_rows() if r["axis"] == "tp"})
    specs = param_shard_specs(trainer.model)  # tp shards gathered to full tensors
    params = {
        n: full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    ref_losses, ref_norms, ref_params, ref_val = delayed_reference(cfg, corpus, steps)
    assert [r.step for r in results] == list(range(steps))
    torch.testing.assert_close(
        torch.tensor([r.loss for r in results]), torch.tensor(ref_losses), rtol=RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor([r.grad_norm for r in results]), torch.tensor(ref_norms), rtol=RTOL, atol=0
    )
    tied = cfg.model.tie_embeddings
    for name, p in params.items():
        ref = ref_params["embed.tok.weight" if tied and name == "head.weight" else name]
        torch.testing.assert_close(p, ref, rtol=RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: n + m)
    assert val == pytest.approx(ref_val, rel=RTOL)
    return {
        "losses": [r.loss for r in results],
        "held": trainer.stream.max_versions_held,
        "storages": trainer.engine.storages(),
        "params": len(trainer.engine.params[0]),
        "tp_ops": tp_ops,
    }


def test_pp2_matches_delayed_reference(world2):
    out = world2.run(_parity, pp=2, accum=4)  # tiny-gpt: tied embeddings, clipping on
    assert out[0]["losses"] == out[1]["losses"]
    # (3) at most two versions needed at once (measured after every action); two where the
    # steps overlap (the first stage; the last stage finishes a step before the next starts);
    # and two copies of the parameters in memory, no more.
    assert [rank["held"] for rank in out] == [2, 1]
    for rank in out:
        assert rank["storages"] == 2 * rank["params"]
    world2.run(_parity, pp=2, accum=3, preset="tiny-llama", grad_clip=0.0, steps=6)
    world2.run(_parity, pp=2, accum=2, recompute="full", dropout=0.1, steps=6)


def test_world4_matches_delayed_reference(world4):
    out = world4.run(_parity, pp=4, accum=4, n_layers=4)
    assert [rank["held"] for rank in out] == [2, 2, 2, 1]
    world4.run(_parity, pp=2, dp=2, accum=2, steps=6)
    out = world4.run(_parity, pp=2, tp=2, accum=4, dropout=0.1)  # tied, vocab-parallel loss
    assert all(rank["tp_ops"] == ["all_reduce"] for rank in out), [r["tp_ops"] for r in out]
    out = world4.run(_parity, pp=2, tp=2, accum=2, preset="tiny-llama", sequence_parallel=True)
    assert all({"all_gather", "reduce_scatter"} <= set(r["tp_ops"]) for r in out), out


# -- (2) it learns ---------------------------------------------------------------------------
def _learn(steps: int) -> tuple[list[float], list[float]]:
    """Losses of every step and validation losses every 10 steps, taken mid-stream."""
    cfg = two_bw_config(pp=2, accum=4, micro=4, steps=steps, lr=3e-3, warmup_steps=3)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    losses: list[float] = []
    vals: list[float] = []
    for step in range(steps):
        losses.append(trainer.train_step().loss)
        if step % 10 == 0:  # between steps the stream is at a consistent cut: collectives work
            vals.append(trainer.evaluate())
    return losses, vals


def test_loss_falls_on_real_data(world2):
    losses, vals = world2.run(_learn, 30)[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses
    assert len(vals) == 3 and vals[0] > vals[1] > vals[2], vals


def _losses(steps: int) -> list[float]:
    cfg = two_bw_config(pp=2, accum=2, steps=steps)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    return [trainer.train_step().loss for _ in range(steps)]


def test_every_rank_reports_the_step_losses(world2):
    out = world2.run(_losses, 4)
    assert out[0] == out[1] and len(out[0]) == 4


# -- (4) no flush between steps ----------------------------------------------------------------
def _timings(pp: int, stage_layers: str = "") -> list:
    # Enough work per stage that compute, not message latency, decides the order of events.
    cfg = two_bw_config(
        preset="small-gpt", pp=pp, accum=4, micro=8, n_layers=2 * pp, stage_layers=stage_layers,
        steps=3,
    )  # fmt: skip
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    for _ in range(cfg.train.steps):
        trainer.train_step()
    return list(trainer.stream.timings)


def _no_flush(timings: list[list]) -> None:
    """Step 1's first forward on rank 0 starts before step 0's last backward on the last rank
    ends: the two steps overlap in time (a flushing schedule would order them)."""
    first_f1 = min(t.start for t in timings[0] if t.action.kind is Kind.F and t.action.step == 1)
    last_b0 = max(t.end for t in timings[-1] if t.action.kind is Kind.B and t.action.step == 0)
    assert first_f1 < last_b0, (first_f1, last_b0)


def test_no_flush_between_steps(world2, world4):
    # pp2: the margin is about the last stage's F + B minus the first stage's B, so give the
    # last stage more layers; with pp4 it is about 3 (F + B) anyway.
    _no_flush(world2.run(_timings, 2, "1,3"))
    _no_flush(world4.run(_timings, 4))


# -- pure: update points and config errors ---------------------------------------------------
def test_update_points_are_consistent_cuts_after_the_step():
    for p in range(1, 6):
        for m in range(p, 2 * p + 2):
            s = two_bw(p, m, steps=4)
            points = update_points(s)
            assert sorted(k for r in points[0].values() for k in r) == [0, 1]
            assert all(len(pts) == 2 for pts in points)
            for step in (0, 1):  # the windowed search agrees with the check of every message
                check_cut(s, update_cut(s, step))
    s = two_bw(4, 8, steps=3)
    cut = update_cut(s, 0)
    for rank, index in enumerate(cut):
        acts = s.ranks[rank]
        first_f2 = next(i for i, a in enumerate(acts) if a.kind is Kind.F and a.step == 2)
        seal = next(i for i, a in enumerate(acts) if a.kind is Kind.STEP and a.step == 0)
        assert seal < index <= first_f2
    assert update_cut(s, 1) is None  # the last two steps update after the stream


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(virtual_stages=2), "2bw does not interleave: got virtual_stages=2"),
        (dict(pp=4, accum=2), "2bw needs micro-batches m >= p .* got m=2, p=4"),
    ],
)
def test_config_errors(over, message):
    cfg = two_bw_config(pp=2, accum=4)
    accum = over.pop("accum", None)
    for key, value in over.items():
        setattr(cfg.parallel, key, value)  # cfg-renames: keep (parallel keys)
    if accum:
        cfg.train.global_batch = cfg.train.micro_batch * accum
    with pytest.raises(ConfigError, match=message):
        check_two_bw(cfg.parallel.pp, cfg.accumulation, cfg.parallel.virtual_stages)
