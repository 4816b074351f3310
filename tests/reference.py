"""Single-process reference training: the plainest loop that defines the right answer.

No plait parallel machinery at all: whole global batch in one forward, torch's own
clip_grad_norm_, the same optimizer/schedule/data/dropout-key rules as the Trainer; packed
rows attend through the dense block-causal mask, which every --packed-attention mode must
equal. Every parallel layout must reproduce its loss every step and its parameters at the end.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from plait.build.corpus import corpus_from_tokens
from plait.build.model import build_model
from plait.config import Config
from plait.data import GlobalBatchSampler, load_tokens
from plait.data.batches import Corpus
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from sections import build_regrouped


@functools.cache
def _tokens(max_bytes: int):
    return load_tokens(None, max_bytes)


def small_config(
    preset: str = "tiny-gpt",
    dp: int = 1,
    micro: int = 2,
    accum: int = 1,
    recompute: str = "none",
    dropout: float = 0.0,
    steps: int = 10,
    bucket_mb: float = 0.02,
    pp: int = 1,
    tp: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    stage_layers: str = "",
    n_layers: int | None = None,
    **train: object,
) -> Config:
    """A tiny run: seconds on CPU, yet every code path (buckets, accumulation) exercised."""
    train_over = {
        "steps": steps,
        "micro_batch": micro,
        "global_batch": micro * accum * dp,
        "seq_len": 32,
        "lr": 1e-3,
        "min_lr": 1e-4,
        "warmup_steps": 2,
        "eval_every": 0,
        "progress": False,
        "out": "/tmp/plait-test-unused",
        **train,
    }
    model = {"dropout": dropout} | ({"n_layers": n_layers} if n_layers else {})
    over = {
        "model": model,
        "parallel": {
            "dp": dp,
            "pp": pp,
            "tp": tp,
            "schedule": schedule,
            "virtual_stages": virtual_stages,
            "stage_layers": stage_layers,
            "bucket_mb": bucket_mb,
            "comm_timeout": 60,
        },
        "memory": {"recompute": recompute},
        "data": {"max_bytes": 300_000},
        "train": train_over,
    }
    cfg = build_regrouped(preset, over)
    cfg.validate()
    return cfg


def corpus_for(cfg: Config) -> Corpus:
    return corpus_from_tokens(_tokens(cfg.data.max_bytes), cfg)


def reference_run(
    cfg: Config, corpus: Corpus
) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Losses and gradient norms per step and final parameters of one process, global batch."""
    model = build_model(cfg.model, torch.device("cpu"), cfg.train.seed)
    losses, norms, params = _train(model, cfg, corpus)
    return losses, norms, params


def _train(model, cfg: Config, corpus: Corpus):
    t = cfg.train
    model.packed_attention = "mask"  # packed rows: the dense block-causal mask is the reference
    opt = build_optimizer(model, cfg.optim)
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    losses, norms = [], []
    model.train()
    for step in range(t.steps):
        idx = sampler.next_batch()
        keys = sample_keys(t.seed, step, torch.arange(t.global_batch))
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        x, y, seg = corpus.train.draw(idx)  # any Rows: text windows or packed rows
        loss = model(x, y, keys, segments=seg)  # the global batch's token-weighted mean
        loss.backward()
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def reference_run_named(cfg: Config, corpus: Corpus):
    """reference_run with parameters by name, plus the final validation loss."""
    t = cfg.train
    model = build_model(cfg.model, torch.device("cpu"), t.seed)
    losses, norms, _ = _train(model, cfg, corpus)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, norms, params, _validation(model, cfg, corpus)


@torch.no_grad()
def _validation(model, cfg: Config, corpus: Corpus) -> float:
    from plait.data import eval_indices

    t = cfg.train
    idx = eval_indices(len(corpus.val), t.eval_batches * t.global_batch)
    model.eval()
    x, y, seg = corpus.val.draw(idx)
    return float(model(x, y, segments=seg))


def assert_matches_reference(
    cfg: Config,
    corpus: Corpus,
    results: list,
    params: dict[str, torch.Tensor],
    val: float,
    param_atol: float = 5e-5,
) -> None:
    """Loss and gradient norm every step (rtol 1e-5), every parameter by name and the
    validation loss must equal the single-process loop's.

    Parameters get an absolute tolerance: Adam divides by sqrt(v), which turns rounding-order
    gradient differences into parameter differences of ~1e-6 after 10 steps (rare elements
    near 2e-5 with many micro-batches); scaling bugs show in the gradient norm.
    """
    ref_losses, ref_norms, ref_params, ref_val = reference_run_named(cfg, corpus)
    rtol = 1e-5
    torch.testing.assert_close(
        torch.tensor([r.loss for r in results]), torch.tensor(ref_losses), rtol=rtol, atol=0
    )
    torch.testing.assert_close(
        torch.tensor([r.grad_norm for r in results]), torch.tensor(ref_norms), rtol=rtol, atol=0
    )
    tied = cfg.model.tie_embeddings
    for name, p in params.items():
        ref = ref_params["embed.tok.weight" if tied and name == "head.weight" else name]
        torch.testing.assert_close(p, ref, rtol=rtol, atol=param_atol, msg=lambda m, n=name: n + m)
    assert abs(val - ref_val) <= rtol * abs(ref_val), (val, ref_val)


class Tiny(nn.Module):
    """Every kind of parameter: embedding and matrix (decay), bias and norm gain (no decay),
    and a frozen matrix (no state at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 3)
        self.frozen = nn.Linear(3, 3, bias=False)
        self.frozen.weight.requires_grad_(False)
