"""The Trainer: build the model, parallelize it, and run the optimization loop.

Order of construction (each step a composable function on an unchanged model):
build on the target device -> layout-independent init -> activation recomputation ->
data-parallel gradient buckets -> optimizer. One step: every rank draws the same global
batch from the seeded sampler, takes its replica's share, runs its micro-batches with
gradient accumulation, reduces gradients over dp, clips by the global norm and steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from plait.comm import Comm
from plait.config import Config
from plait.data import (
    GlobalBatchSampler,
    TokenWindows,
    eval_indices,
    load_tokens,
    replica_share,
    split_micro,
    split_tokens,
    unigram_entropy,
)
from plait.device import synchronize
from plait.mesh import Mesh
from plait.models.config import ModelConfig
from plait.models.dropout import sample_keys
from plait.models.init import init_parameters, initial_values, tie_all
from plait.models.transformer import Transformer
from plait.optim import build_optimizer, lr_at, scale_to_norm, set_lr
from plait.parallel.data_parallel import DataParallel
from plait.parallel.grad_norm import global_grad_norm
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.runtime import MicroBatch
from plait.parallel.recompute import apply_recompute
from plait.parallel.tensor_parallel import apply_tensor_parallel, sync_sequence_parallel_grads
from plait.parallel.zero import AdamW, ZeroEngine
from plait.parallel.zero.split_model import isolated_params, norm_rules, sync_split_grads
from plait.precision import parse_precision


@dataclass
class StepResult:
    """What one optimizer step produced (the same on every rank)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    time_s: float
    tokens: int


def build_model(
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    parallelize: Callable[[Transformer], None] | None = None,
    materialize: bool = True,
) -> Transformer:
    """Build on the meta device, parallelize, then materialize on `device` and initialize.

    Building on meta first means a model too large for one device is never allocated whole:
    `parallelize` (tensor-parallel sharding, pipeline stage split) shrinks it before any
    memory is touched, and each parameter (or shard) is then filled from its (seed, name)
    generator, so the values do not depend on the layout. With `materialize=False` the
    parameters are moved to `device` holding zero bytes and left uninitialized: ZeRO stage 3
    fills its shards from `initial_values` and binds the parameters to its own buffers.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if parallelize is not None:
        parallelize(model)
    if materialize:
        model.to_empty(device=device)
        init_parameters(model, seed, cfg)
    else:
        _to_device_without_storage(model, device)
    return model


def _to_device_without_storage(model: nn.Module, device: torch.device) -> None:
    """Every parameter on `device` with zero-byte storage, one allocated at a time.

    This is `Module.to_empty` (which goes through the same `_apply`) except that each new
    tensor gives its memory back at once, so the model never exists whole."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device=device)
        out.untyped_storage().resize_(0)
        return out

    model._apply(empty)
    tie_all(model)


@dataclass
class Corpus:
    """Training and validation windows plus the baseline the model must beat."""

    train: TokenWindows
    val: TokenWindows
    unigram_baseline: float


def load_corpus(cfg: Config) -> Corpus:
    tokens = load_tokens(cfg.data.path, cfg.data.max_bytes)
    return corpus_from_tokens(tokens, cfg)


def corpus_from_tokens(tokens: np.ndarray, cfg: Config) -> Corpus:
    train, val = split_tokens(tokens, cfg.data.val_fraction)
    seq = cfg.train.seq_len
    return Corpus(TokenWindows(train, seq), TokenWindows(val, seq), unigram_entropy(train))


def _zero_engine(
    cfg: Config, model: Transformer, comm: Comm, pipeline: PipelineEngine | None
) -> ZeroEngine:
    par = cfg.parallel
    streamed = _streams_init(cfg)
    return ZeroEngine(
        model,
        comm,
        AdamW.from_train(cfg.train),
        stage=par.zero,
        precision=parse_precision(par.precision, par.reduce_dtype),
        offload=par.offload,
        offload_dir=par.offload_dir,
        bucket_mb=par.bucket_mb,
        isolate=isolated_params(model, pipeline),
        initial_value=initial_values(model, cfg.train.seed, cfg.model) if streamed else None,
    )


def _streams_init(cfg: Config) -> bool:
    """ZeRO stage 3 initializes shard by shard: the full model is never materialized."""
    return cfg.parallel.uses_zero_engine and cfg.parallel.zero == 3


class Trainer:
    """One rank's share of a training run."""

    def __init__(self, cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.device = mesh.device
        self.comm = Comm(mesh)
        self.corpus = corpus or load_corpus(cfg)
        self.pipeline = PipelineEngine(cfg, mesh, self.comm) if mesh.size("pp") > 1 else None
        self.model = build_model(
            cfg.model, self.device, cfg.train.seed, self._parallelize, not _streams_init(cfg)
        )
        apply_recompute(self.model, cfg.parallel.recompute)
        self.zero = (
            _zero_engine(cfg, self.model, self.comm, self.pipeline)
            if cfg.parallel.uses_zero_engine
            else None
        )
        self.dp = None if self.zero else DataParallel(self.model, self.comm, cfg.parallel.bucket_mb)
        if self.pipeline and self.zero:
            dtype = self.zero.precision.param_dtype
            self.pipeline.attach(self.model, self.zero, dtype, self.zero.scale_loss)
        elif self.pipeline:
            self.pipeline.attach(self.model, self.dp)
        self.optimizer = None if self.zero else build_optimizer(self.model, cfg.train)
        self.sampler = GlobalBatchSampler(
            len(self.corpus.train), cfg.train.global_batch, cfg.train.seed
        )
        self.step = 0

    def _parallelize(self, model: Transformer) -> None:
        """On the meta model, in DESIGN's order: tensor parallel, then the pipeline split."""
        apply_tensor_parallel(model, self.mesh, self.comm, self.cfg.parallel.sequence_parallel)
        if self.pipeline:
            self.pipeline.prune(model)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def train_step(self) -> StepResult:
        """One optimizer step over one global batch; returns the global mean loss."""
        t = self.cfg.train
        start = time.perf_counter()
        self.comm.stats.begin_step(self.step)
        share, positions = replica_share(
            self.sampler.next_batch(), self.mesh.coord.dp, self.mesh.size("dp")
        )
        keys = sample_keys(t.seed, self.step, positions)
        micro_idx, micro_keys = split_micro(share, t.micro_batch), split_micro(keys, t.micro_batch)
        lr = lr_at(self.step, t)
        self.model.train()
        if self.zero:
            mean_loss, grad_norm = self._zero_step(micro_idx, micro_keys, lr)
        else:
            mean_loss, grad_norm = self._replicated_step(micro_idx, micro_keys, lr)
        self.comm.all_reduce(mean_loss, "dp", op="avg", tag="loss")
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        return StepResult(
            self.step - 1, float(mean_loss), lr, grad_norm, elapsed, self.tokens_per_step
        )

    def _replicated_step(self, micro_idx: list, micro_keys: list, lr: float):
        """DataParallel (ZeRO stage 0) with torch AdamW; with or without tp and pp."""
        t = self.cfg.train
        set_lr(self.optimizer, lr)
        if self.pipeline:
            micro = [self._micro(idx, key) for idx, key in zip(micro_idx, micro_keys, strict=True)]
            mean_loss = self.pipeline.run(micro)
        else:
            mean_loss = self._accumulate(micro_idx, micro_keys, self.dp)
        self.dp.finish()
        sync_sequence_parallel_grads(self.model, self.comm)  # no-op without it
        if self.pipeline:
            self.pipeline.sync_tied_grads()
        norm = global_grad_norm(self.model, self.dp, self.comm, self.pipeline)
        scale_to_norm(self.dp.grad_buffers(), norm, t.grad_clip)
        grad_norm = float(norm)
        self.optimizer.step()
        self.dp.zero_grad()
        return mean_loss, grad_norm

    def _zero_step(self, micro_idx: list, micro_keys: list, lr: float):
        """The ZeRO engine: sharded states, mixed precision, offload (fp16 may skip a step);
        with or without tp and pp."""
        engine = self.zero
        engine.begin_step()
        if self.pipeline:
            micro = [self._micro(idx, key) for idx, key in zip(micro_idx, micro_keys, strict=True)]
            mean_loss = self.pipeline.run(micro)
        else:
            mean_loss = self._accumulate(micro_idx, micro_keys, engine)
        engine.finish()
        sync_split_grads(engine, self.model, self.pipeline)
        reduce_sq, weight = norm_rules(self.model, self.comm, self.pipeline)
        grad_norm = engine.clip_grad_norm(self.cfg.train.grad_clip, reduce_sq, weight)
        engine.step(lr)
        engine.zero_grad()
        return mean_loss, grad_norm

    def _micro(self, idx: torch.Tensor, key: torch.Tensor) -> MicroBatch:
        x, y = (v.to(self.device) for v in self.corpus.train.batch(idx))
        return MicroBatch(x, y, key.to(self.device))

    def _accumulate(
        self, micro_idx: list, micro_keys: list, grads: DataParallel | ZeroEngine
    ) -> torch.Tensor:
        """Gradient accumulation without a pipeline; returns the mean micro-batch loss.
        `grads` is told where each micro-batch falls and scales the loss (fp16)."""
        loss_sum = torch.zeros((), device=self.device)
        n = len(micro_idx)
        scale = grads.scale_loss if isinstance(grads, ZeroEngine) else None
        for i, (idx, key) in enumerate(zip(micro_idx, micro_keys, strict=True)):
            mb = self._micro(idx, key)
            grads.micro_batch(is_last=i == n - 1)
            loss = self.model(mb.tokens, mb.targets, mb.keys)  # mean over its tokens
            (scale(loss / n) if scale else loss / n).backward()
            loss_sum += loss.detach().float()
        return loss_sum / n

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows, split across replicas."""
        t = self.cfg.train
        idx = eval_indices(len(self.corpus.val), t.eval_batches * t.global_batch)
        mine = torch.tensor_split(idx, self.mesh.size("dp"))[self.mesh.coord.dp]
        self.model.eval()
        batches = []
        for chunk in torch.split(mine, t.micro_batch):
            x, y = (v.to(self.device) for v in self.corpus.val.batch(chunk))
            batches.append(MicroBatch(x, y, torch.zeros(len(chunk), dtype=torch.int64)))
        if self.pipeline:
            totals = self.pipeline.evaluate(batches)
        else:
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss sum, tokens)
            for mb in batches:
                totals[0] += self.model(mb.tokens, mb.targets).double() * mb.targets.numel()
                totals[1] += mb.targets.numel()
        self.comm.all_reduce(totals, "dp", op="sum", tag="eval")
        return float(totals[0] / totals[1])

    def close(self) -> None:
        if self.zero:
            self.zero.close()
        else:
            self.dp.remove_hooks()


def injected_fault(rank: int, step: int) -> None:
    """Test hook: PLAIT_FAULT='RANK:STEP' makes that rank raise at that step.

    It exists so the failure path (one rank dies, all stop, its traceback shown) is tested
    end to end through the real launcher.
    """
    spec = os.environ.get("PLAIT_FAULT")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected fault (PLAIT_FAULT={spec}) on rank {rank} at step {step}")
