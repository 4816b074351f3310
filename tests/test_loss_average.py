"""`--loss-average micro-batch`: transformers' rule before PR #34191 (each micro-batch's own
target mean, averaged over micro-batches and replicas), for the finetune lesson's comparison.
At dp2 with accumulation 2 on packed, masked rows (tests/packed_rows.py), plait's DDP and
naive data parallelism give the loss and gradient norm of that rule written out directly in
one process, every step (fp32, rtol 1e-5), while the default stays the token-weighted
reference; on text windows (every micro-batch full) both rules give the same divisors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packed_rows import PackedRows, packed_corpus
from plait.build.model import build_model
from plait.config import Config
from plait.data import GlobalBatchSampler
from plait.data.batches import Corpus, StepBatches
from plait.data.sampler import replica_share, split_micro
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from plait.train import Trainer
from reference import corpus_for, reference_run, small_config

RTOL = 1e-5
STEPS = 3


def micro_mean_reference(cfg: Config, corpus: Corpus) -> tuple[list[float], list[float]]:
    """The old rule written out: per replica, per micro-batch, the mean over its targets
    (0 without any); the step's loss is the mean of those means; clip, AdamW."""
    t, dp = cfg.train, cfg.parallel.dp
    model = build_model(cfg.model, torch.device("cpu"), t.seed)
    opt = build_optimizer(model, cfg.optim)
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        idx = sampler.next_batch()
        means = []
        for r in range(dp):
            share, positions = replica_share(idx, r, dp)
            keys = sample_keys(t.seed, step, positions)
            for i, k in zip(split_micro(share, t.micro_batch), split_micro(keys, t.micro_batch),
                            strict=True):  # fmt: skip
                x, y, seg = corpus.train.draw(i)
                means.append(model(x, y, k, segments=seg))  # denom None: its own mean
        loss = torch.stack(means).mean()
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def run_layout(dp_mode: str, loss_average: str) -> tuple[list[float], list[float]]:
    """Losses and gradient norms of dp2 x accumulation 2 (micro-batches of one row)."""
    cfg = small_config(dp=2, micro=1, accum=2, steps=STEPS, loss_average=loss_average)
    cfg.parallel.dp_mode = dp_mode
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, packed_corpus(cfg))
    results = [trainer.train_step() for _ in range(STEPS)]
    trainer.close()
    return [r.loss for r in results], [r.grad_norm for r in results]


@pytest.fixture(scope="module")
def references():
    cfg = small_config(dp=2, micro=1, accum=2, steps=STEPS, loss_average="micro-batch")
    corpus = packed_corpus(cfg)
    old = micro_mean_reference(cfg, corpus)
    exact = reference_run(cfg, corpus)[:2]
    return old, exact


@pytest.mark.parametrize("dp_mode", ["ddp", "naive"])
def test_micro_batch_average_is_the_mean_of_micro_batch_means(world2, references, dp_mode):
    (old_losses, old_norms), (exact_losses, _) = references
    losses, norms = world2.run(run_layout, dp_mode, "micro-batch")[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(old_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(old_norms), rtol=RTOL, atol=0)
    assert abs(losses[0] - exact_losses[0]) > 100 * RTOL * exact_losses[0]  # the rules differ


def test_the_default_stays_token_weighted(world2, references):
    _, (exact_losses, exact_norms) = references
    losses, norms = world2.run(run_layout, "ddp", "tokens")[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(exact_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(exact_norms), rtol=RTOL, atol=0)


def _denoms(corpus: Corpus, rule: str, whole: bool = False) -> list:
    """Replica 0's divisors (or a whole micro-batch's per share) of step 0 at dp2, 2 x 2 rows."""
    batches = StepBatches(corpus, 8, 2, 0, (0, 2), torch.device("cpu"), rule)
    micro = batches.draw_whole(0) if whole else batches.draw(0)
    return [mb.share_denoms or mb.denom for mb in micro]


def test_divisors_of_each_rule():
    """micro-batch: own targets (at least 1) x micro-batches per replica, dp times that in a
    naive-DP whole micro-batch; on text windows the two rules' divisors are equal."""
    rows = PackedRows(32, 16, 50, seed=3)
    corpus = Corpus(rows, rows, 0.0)
    idx = GlobalBatchSampler(len(rows), 8, 0).next_batch()
    mine = split_micro(replica_share(idx, 0, 2)[0], 2)
    own = [max(rows.target_count(m), 1) * 2.0 for m in mine]
    assert _denoms(corpus, "micro-batch") == own
    assert _denoms(corpus, "tokens") == [rows.target_count(idx) / 2] * 2
    whole = _denoms(corpus, "micro-batch", whole=True)
    assert [w[0] for w in whole] == [2 * d for d in own] and len(whole[0]) == 2
    text = corpus_for(small_config())
    assert _denoms(text, "micro-batch") == _denoms(text, "tokens") == [2 * 32 * 2.0] * 2
    why = "loss_average must be one of tokens, micro-batch; got 'mean'"
    with pytest.raises(ConfigError, match=why):
        StepBatches(corpus, 8, 2, 0, (0, 2), torch.device("cpu"), "mean")
    cfg = small_config()
    cfg.train.loss_average = "mean"
    with pytest.raises(ConfigError, match=why):
        cfg.validate()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_left_without_validation_rows_runs_a_forward_of_intact_tokens(rank):
    """One validation window over dp 2: replica 1 holds no row, so it runs a micro-batch
    without targets (ZeRO-3 needs every replica's forward). A window's targets share storage
    with its tokens: blanking the targets must leave the tokens alone (it once wrote -100
    into them, and the embedding failed)."""
    from plait.data.sampler import TokenWindows

    rows = TokenWindows(np.arange(1, 10, dtype=np.int64), 8)  # one window of 8
    assert len(rows) == 1
    train = TokenWindows(np.arange(1, 34, dtype=np.int64), 8)  # four windows
    batches = StepBatches(Corpus(train, rows, 0.0), 2, 1, 0, (rank, 2), torch.device("cpu"))
    (mb,) = batches.validation(1)
    x, y, _ = rows.draw(torch.tensor([0]))
    assert torch.equal(mb.tokens, x)
    assert torch.equal(mb.targets, y if rank == 0 else torch.full_like(y, -100))
    assert int(mb.tokens.min()) >= 0
