"""Shared helpers of the ZeRO tests (no tests here): the reference, and the real step.

`reference(cfg, corpus)` is the plain data-parallel loop that defines the right answer on
this rank: every `p.grad` all-reduced on its own (divided by dp first, as the engine's
buckets are, so the two agree bitwise), torch's AdamW and clip_grad_norm_, the Trainer's
sampler, replica share, micro-batches and dropout keys.

`train(cfg, corpus, stage, ...)` runs the engine under test through the production step,
`Trainer.train_step` (`plait.step.Step`): the ZeRO options go into the config, so a drift in
the real step or in how the Trainer builds its engine fails the parity tests. Both record
the same things every step (loss, gradient norm, this rank's gradients before clipping, the
step's communication rows, the engine's memory report) and the final parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from plait.build.model import build_model
from plait.comm import Comm
from plait.config import Config
from plait.data import GlobalBatchSampler, replica_share, split_micro
from plait.data.batches import Corpus, StepBatches
from plait.mesh import build_mesh
from plait.mixed_precision import parse_precision
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions
from plait.step import Accumulate, Step, StepResult
from plait.train import Trainer
from reference import corpus_for, small_config


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


@dataclass
class Record:
    """What a run did, step by step, on this rank."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    grads: list[dict] = field(default_factory=list)  # reference: {name: flat gradient};
    # engine: {(name, start): this rank's piece}, unscaled
    stats: list[list[dict]] = field(default_factory=list)  # the step's communication rows
    memory: list[dict] = field(default_factory=list)  # the engine's report after each step
    params: dict[str, Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # reference only


def reference(cfg: Config, corpus: Corpus) -> Record:
    """The plain data-parallel loop (module doc), `cfg.train.steps` steps."""
    t = cfg.train
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    comm, n = Comm(mesh), mesh.size("dp")
    model = build_model(cfg.model, mesh.device, t.seed)
    apply_recompute(model, cfg.memory.recompute)
    opt = build_optimizer(model, cfg.optim)
    params = list(model.parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    out = Record()
    model.train()
    for step in range(t.steps):
        indices = sampler.next_batch()
        denom = max(corpus.train.target_count(indices), 1) / n  # plait's loss rule
        share, positions = replica_share(indices, mesh.coord.dp, n)
        keys = sample_keys(t.seed, step, positions)
        micro_idx, micro_keys = split_micro(share, t.micro_batch), split_micro(keys, t.micro_batch)
        total = torch.zeros(())
        for idx, key in zip(micro_idx, micro_keys, strict=True):
            x, y, seg = corpus.train.draw(idx)
            loss = model(x, y, key, segments=seg, denom=denom)  # summed target losses / denom
            loss.backward()
            total += loss.detach().float()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(n)
            comm.all_reduce(p.grad, "dp", op="sum", tag="grad")
        out.grads.append({names[id(p)]: p.grad.detach().reshape(-1).clone() for p in params})
        if cfg.optim.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip))
        else:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        out.norms.append(norm)
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = total  # this replica's share: the dp average is the global loss
        comm.all_reduce(mean, "dp", op="avg", tag="loss")
        out.losses.append(float(mean))
    for name, p in model.named_parameters():
        out.params[name] = p.detach().clone()
        state = {k: v.clone() for k, v in opt.state[p].items()}
        out.optimizer[name] = {"master": p.detach().clone(), **state}
    return out


def with_zero(
    cfg: Config,
    stage: int,
    precision: str = "fp32",
    reduce: str | None = None,
    offload: str = "none",
    offload_dir: str | None = None,
    bucket_mb: float | None = None,
) -> Config:
    """A validated copy of `cfg` with these ZeRO options (`cfg` is left as it was)."""
    cfg = copy.deepcopy(cfg)
    par = cfg.parallel
    cfg.memory.zero, cfg.train.precision, cfg.train.reduce_dtype = stage, precision, reduce
    cfg.memory.offload, cfg.memory.offload_dir = offload, offload_dir
    if bucket_mb is not None:
        par.bucket_mb = bucket_mb
    cfg.validate()
    return cfg


def zero_trainer(cfg: Config, corpus: Corpus, stage: int, **options: object) -> Trainer:
    """The production Trainer of `cfg` with these ZeRO options (`with_zero`)."""
    cfg = with_zero(cfg, stage, **options)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    return Trainer(cfg, mesh, corpus)


class EngineStep:
    """The production step and runner over an engine the test builds, for an engine option
    no config field carries (the NVMe sub-group size); otherwise built as the Trainer builds
    a run without pipeline: `build/rank.py`'s order, `cfg`'s ZeRO options (`with_zero`)."""

    def __init__(self, cfg: Config, corpus: Corpus, **engine: object) -> None:
        t, par = cfg.train, cfg.parallel
        mesh = build_mesh(par.layout, torch.device("cpu"), par.comm_timeout)
        self.cfg, self.comm, self.step = cfg, Comm(mesh), 0
        self.model = build_model(cfg.model, mesh.device, t.seed)
        apply_recompute(self.model, cfg.memory.recompute)
        options = ZeroOptions(
            stage=cfg.memory.zero,
            precision=parse_precision(cfg.train.precision, cfg.train.reduce_dtype),
            offload=cfg.memory.offload,
            offload_dir=cfg.memory.offload_dir,
            bucket_mb=par.bucket_mb,
            **engine,
        )
        self.engine = ZeroEngine(self.model, self.comm, AdamW.from_optim(cfg.optim), options)
        replica = (mesh.coord.dp, mesh.size("dp"))
        batches = StepBatches(corpus, t.global_batch, t.micro_batch, t.seed, replica, mesh.device)
        runner = Accumulate(self.model, self.engine, batches)
        rules = SplitGradRules.of(self.model, mesh)
        self._step = Step(self.engine, runner, rules, self.comm, t, cfg.optim)

    def train_step(self) -> StepResult:
        result = self._step(self.step)
        self.step += 1
        return result

    def close(self) -> None:
        self.engine.close()


def grad_pieces(engine: ZeroEngine) -> dict[tuple[str, int], Tensor]:
    """{(name, start): gradient piece} of this rank's shards, unscaled."""
    out = {}
    for g, shard in zip(engine.groups, engine.grad_shards(), strict=True):
        for piece in g.pieces():
            lo = piece.shard_offset
            grad = shard[lo : lo + piece.length].float() / engine.loss_scale
            out[(g.names[piece.param], piece.start)] = grad.clone()
    return out


@contextmanager
def after_finish(engine: ZeroEngine, then: Callable[[], None]) -> Iterator[None]:
    """Call `then()` inside every real step once its gradient reduction has finished
    (before the split-model rules and clipping): `engine.finish` is wrapped on this
    instance, the one way to look inside the production step without a copy of it."""
    finish = engine.finish

    def finish_then() -> None:
        finish()
        then()

    engine.finish = finish_then
    try:
        yield
    finally:
        del engine.finish


def record(trainer: Trainer | EngineStep, steps: int | None = None) -> Record:
    """Run `steps` real steps (default: the config's) and record them (module doc)."""
    engine: ZeroEngine = trainer.engine
    out = Record()
    with after_finish(engine, lambda: out.grads.append(grad_pieces(engine))):
        for _ in range(trainer.cfg.train.steps if steps is None else steps):
            result = trainer.train_step()
            out.losses.append(result.loss)
            out.norms.append(result.grad_norm)
            out.stats.append(trainer.comm.stats.as_rows())
            out.memory.append(engine.memory.report())
    with engine.unsharded():
        out.params = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    return out


def train(cfg: Config, corpus: Corpus, stage: int, **options: object) -> tuple[Record, Trainer]:
    """The config's steps of the Trainer with these ZeRO options (`with_zero`), recorded;
    the trainer is returned open (its engine is read after), for the caller to close."""
    trainer = zero_trainer(cfg, corpus, stage, **options)
    return record(trainer), trainer


# ---------------------------------------------------------------- parity (test_zero_parity's doc)

RTOL = 1e-6
PARAM_ATOL = 1e-5
PARAM_REL_L2 = 1e-5
NOISE_PARAMS = ("attn.wk.bias",)  # all noise: only the absolute bound applies


def compare(ref: Record, got: Record, exact: bool) -> None:
    """Loss and norm per step, this rank's gradient pieces, final parameters."""
    if exact:
        assert got.losses == ref.losses  # the norm is summed in another order
    close = dict(rtol=RTOL, atol=0.0)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), **close)
    torch.testing.assert_close(torch.tensor(got.norms), torch.tensor(ref.norms), **close)
    assert len(got.grads) == len(ref.grads)
    for step, (rg, gg) in enumerate(zip(ref.grads, got.grads, strict=True)):
        assert gg
        for (name, start), piece in gg.items():
            expect = rg[name][start : start + piece.numel()]
            if exact:
                assert torch.equal(piece, expect), f"step {step} grad {name}[{start}:]"
            elif step == 0:
                atol = RTOL * float(rg[name].abs().max())
                torch.testing.assert_close(piece, expect, rtol=RTOL, atol=atol)
    for name, expect in ref.params.items():
        value = got.params[name]
        if exact:
            assert torch.equal(value, expect), name
        torch.testing.assert_close(value, expect, rtol=0.0, atol=PARAM_ATOL, msg=name)
        if not name.endswith(NOISE_PARAMS):
            assert float((value - expect).norm() / expect.norm()) <= PARAM_REL_L2, name


def parity(stages: list[int], exact: bool, clip: float, **kw: object) -> dict:
    """The reference once, then each stage in `stages` through the Trainer, compared;
    returns each stage's padding, flat groups and covered elements, and the model's size."""
    cfg = zero_config(**kw)
    cfg.optim.grad_clip = clip
    corpus = corpus_for(cfg)
    ref = reference(cfg, corpus)
    out: dict = {}
    for stage in stages:
        got, trainer = train(cfg, corpus, stage)
        compare(ref, got, exact)
        engine = trainer.engine
        out[stage] = {
            "padding": sum(g.padding for g in engine.groups),
            "groups": len(engine.groups),
            "elements": sum(p.length for p in engine.state_dict()["pieces"]),
        }
        trainer.close()
    out["numel"] = sum(p.numel() for p in ref.params.values())
    return out
