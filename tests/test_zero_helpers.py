"""Shared helpers of the ZeRO tests (no tests here): one training loop, two ways to run it.

`run(cfg, corpus, kind, ...)` trains on this rank exactly as the Trainer does (same
sampler, replica share, micro-batches, dropout keys, schedule, clipping) with either the
plain reference (per-parameter all-reduce + torch.optim.AdamW) or a `ZeroEngine`, and
records loss, gradient norm and this rank's gradients every step, and the final parameters.
"""

from __future__ import annotations

import torch

from plait.comm import Comm
from plait.config import Config
from plait.data import GlobalBatchSampler, replica_share, split_micro
from plait.mesh import build_mesh
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules, clip_coef
from plait.parallel.zero.engine import ZeroEngine
from plait.train import build_model
from reference import small_config


def zero_config(
    preset: str = "tiny-gpt",
    dp: int = 2,
    accum: int = 1,
    steps: int = 10,
    recompute: str = "none",
    dropout: float = 0.0,
    **model: object,
) -> Config:
    """small_config with model overrides (odd widths make uneven shards)."""
    cfg = small_config(
        preset=preset, dp=dp, accum=accum, steps=steps, recompute=recompute, dropout=dropout
    )
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.model.validate()
    return cfg


class DPAdapter:
    """The reference: every `p.grad` all-reduced on its own (no buckets, no engine), torch
    AdamW and torch's clip_grad_norm_. Each gradient is divided by dp before the sum, as the
    engine's buckets are, so the two agree bitwise."""

    def __init__(self, model, comm: Comm, cfg: Config) -> None:
        self.model, self.comm, self.cfg = model, comm, cfg
        self.opt = build_optimizer(model, cfg.train)
        self.names = {id(p): n for n, p in model.named_parameters()}

    def micro_batch(self, is_last: bool) -> None:
        pass

    def scale_loss(self, loss):
        return loss

    def finish(self) -> dict[str, torch.Tensor]:
        n = self.comm.mesh.size("dp")
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(n)
            self.comm.all_reduce(p.grad, "dp", op="sum", tag="grad")
        return {
            self.names[id(p)]: p.grad.detach().reshape(-1).clone() for p in self.model.parameters()
        }

    def clip_and_step(self, lr: float) -> float:
        params = list(self.model.parameters())
        clip = self.cfg.train.grad_clip
        if clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        else:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        set_lr(self.opt, lr)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def close(self) -> None:
        pass


class EngineAdapter:
    """A ZeroEngine in the same loop; gradients reported as this rank's pieces."""

    def __init__(self, model, comm: Comm, cfg: Config, **engine: object) -> None:
        self.model, self.cfg = model, cfg
        bucket_mb = engine.pop("bucket_mb", cfg.parallel.bucket_mb)
        opt = AdamW.from_train(cfg.train)
        self.engine = ZeroEngine(model, comm, opt, bucket_mb=bucket_mb, **engine)
        self.rules = SplitGradRules.of(model, comm.mesh)

    def micro_batch(self, is_last: bool) -> None:
        self.engine.micro_batch(is_last)

    def scale_loss(self, loss):
        return self.engine.scale_loss(loss)

    def finish(self) -> dict[str, tuple[int, torch.Tensor]]:
        """{(name, start): gradient piece} of this rank's shards (unscaled)."""
        self.engine.finish()
        out = {}
        for g, shard in zip(self.engine.groups, self.engine.grad_shards(), strict=True):
            for piece in g.pieces():
                lo = piece.shard_offset
                grad = shard[lo : lo + piece.length].float() / self.engine.loss_scale
                out[(g.names[piece.param], piece.start)] = grad.clone()
        return out

    def clip_and_step(self, lr: float) -> float:
        norm = self.engine.grad_norm(self.rules)
        self.engine.clip(clip_coef(norm, self.cfg.train.grad_clip))
        self.engine.step(lr)
        self.engine.zero_grad()
        return float(norm)

    def params(self) -> dict[str, torch.Tensor]:
        with self.engine.unsharded():
            return {n: p.detach().float().clone() for n, p in self.model.named_parameters()}

    def close(self) -> None:
        self.engine.close()


def run(cfg: Config, corpus, kind: str = "dp", steps: int | None = None, **engine: object):
    """Train `steps` steps on this rank; returns a dict of what happened (see module doc)."""
    t = cfg.train
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    comm = Comm(mesh)
    model = build_model(cfg.model, mesh.device, t.seed)
    apply_recompute(model, cfg.parallel.recompute)
    adapter = (
        DPAdapter(model, comm, cfg) if kind == "dp" else EngineAdapter(model, comm, cfg, **engine)
    )
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    out: dict = {"losses": [], "norms": [], "grads": [], "stats": []}
    model.train()
    for step in range(steps or t.steps):
        comm.stats.begin_step(step)
        if kind != "dp":
            adapter.engine.begin_step()
        share, positions = replica_share(sampler.next_batch(), mesh.coord.dp, mesh.size("dp"))
        keys = sample_keys(t.seed, step, positions)
        micro_idx, micro_keys = split_micro(share, t.micro_batch), split_micro(keys, t.micro_batch)
        total = torch.zeros(())
        for i, (idx, key) in enumerate(zip(micro_idx, micro_keys, strict=True)):
            x, y = corpus.train.batch(idx)
            adapter.micro_batch(is_last=i == len(micro_idx) - 1)
            loss = model(x, y, key)
            adapter.scale_loss(loss / len(micro_idx)).backward()
            total += loss.detach().float()
        out["grads"].append(adapter.finish())
        out["norms"].append(adapter.clip_and_step(lr_at(step, t)))
        mean = total / len(micro_idx)
        out["stats"].append(comm.stats.as_rows())
        if kind != "dp":
            out.setdefault("memory", []).append(adapter.engine.memory.report())
        comm.all_reduce(mean, "dp", op="avg", tag="loss")
        out["losses"].append(float(mean))
    out["params"] = adapter.params()
    out["adapter"] = adapter
    return out
