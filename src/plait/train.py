"""Build one rank's share of a training run: model, engine, runner; `step.py` runs it.

Order of construction, in DESIGN's order, each a composable function on an unchanged model:
build on the meta device -> tensor parallel -> pipeline stage split -> materialize and
initialize (layout-independent) -> activation recomputation -> optimizer engine (ZeRO stage
0-3; stage 0 is plain data parallelism; 2BW: two weight versions). The runner that executes a
step's micro-batches follows from the layout: plain accumulation, a pipeline schedule, or the
asynchronous 2BW stream.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.checkpoint import base as ckpt_base
from plait.checkpoint import io as ckpt_io
from plait.checkpoint import store
from plait.comm import Comm
from plait.config import Config
from plait.context_batches import ContextBatches
from plait.data import baseline_sample, load_stream, split_windows, unigram_entropy
from plait.data.batches import Corpus, StepBatches
from plait.data.examples import example_corpus, is_examples_dir
from plait.data.sampler import TokenWindows
from plait.data.shards import ShardStream
from plait.data.split import whole_stream
from plait.mesh import Mesh
from plait.mixed_precision import parse_base_dtype, parse_precision
from plait.models.architecture import ModelConfig
from plait.models.hf.load import hf_source
from plait.models.hf.peft import adapter_source
from plait.models.init import (
    ValueSource,
    fill_parameters,
    seeded,
    source_values,
    tie_all,
    with_adapters,
)
from plait.models.nf4.source import nf4_source
from plait.models.transformer import Transformer
from plait.parallel.activation_offload import apply_activation_offload
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules, tied_embedding_params
from plait.parallel.naive_dp import Coordinator, ScatterGather
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.parallel.partition_activations import apply_partition_activations
from plait.parallel.pipeline.driver import PipelineDriver
from plait.parallel.pipeline.two_bw import TwoBWStream
from plait.parallel.pipeline.weight_versions import WeightVersions
from plait.parallel.tp.apply import apply_tensor_parallel
from plait.parallel.zero.engine import ZeroEngine
from plait.step import Accumulate, Pipelined, Runner, Step, StepResult, evaluate_loss
from plait.torch_private import replace_tensors


def build_model(
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    parallelize: Callable[[Transformer], None] | None = None,
    materialize: bool = True,
    source: ValueSource | None = None,
) -> Transformer:
    """Build on the meta device, parallelize, then materialize on `device` and initialize.

    Building on meta first means a model too large for one device is never allocated whole:
    `parallelize` (tensor-parallel sharding, pipeline stage split) shrinks it before any
    memory is touched, and each parameter (or shard) is then filled from its (seed, name)
    generator, so the values do not depend on the layout. With `materialize=False` the
    parameters are moved to `device` holding zero bytes and left uninitialized: ZeRO stage 3
    fills its shards from `initial_values` and binds the parameters to its own buffers.
    `source` replaces the seeded values (a Hugging Face folder: `first_weights`).
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if parallelize is not None:
        parallelize(model)
    if materialize:
        model.to_empty(device=device)
        fill_parameters(model, source or seeded(cfg, seed))
    else:
        _to_device_without_storage(model, device)
    return model


def _to_device_without_storage(model: nn.Module, device: torch.device) -> None:
    """Every parameter on `device` with zero-byte storage, one allocated at a time.

    This is `Module.to_empty` (which goes through the same walk) except that each new
    tensor gives its memory back at once, so the model never exists whole."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device=device)
        out.untyped_storage().resize_(0)
        return out

    replace_tensors(model, empty)  # torch's private Module._apply: torch_private says why
    tie_all(model)


def load_corpus(cfg: Config) -> Corpus:
    """Raw text read into memory, prepared shards memory-mapped (data/stream.py), or an
    examples folder's packed rows (data/examples.py: IGNORE targets and segments, which the
    model and the loss rule consume; every rank builds the same rows)."""
    d = cfg.data
    if is_examples_dir(d.path):
        made = example_corpus(d.path, cfg.train.seq_len, d.val_fraction, d.pack, d.long,
                              d.eval_data)  # fmt: skip
        return Corpus(made.train, made.val, made.baseline, made.report)
    tokens = load_stream(d.path, d.tokenizer, d.max_bytes)
    if d.eval_data is not None:
        return corpus_with_eval(tokens, load_stream(d.eval_data, d.tokenizer, d.max_bytes), cfg)
    return corpus_from_tokens(tokens, cfg)


def corpus_from_tokens(tokens: np.ndarray | ShardStream, cfg: Config) -> Corpus:
    """Training and validation windows of one stream, split by `split_windows` (evenly
    spaced blocks, data/split.py); both sides read the same tokens, nothing is copied."""
    seq = cfg.train.seq_len
    split = split_windows(len(tokens), seq, cfg.data.val_fraction)
    if not isinstance(tokens, ShardStream) and not tokens.flags.writeable:
        tokens = tokens.copy()  # TokenWindows would copy a read-only array once per side
    baseline = unigram_entropy(baseline_sample(tokens, split.train))
    return Corpus(
        TokenWindows(tokens, seq, split.train), TokenWindows(tokens, seq, split.val), baseline
    )


def corpus_with_eval(
    tokens: np.ndarray | ShardStream, held: np.ndarray | ShardStream, cfg: Config
) -> Corpus:
    """Every window of `tokens` to train on, every window of `held` (`--eval-data`) to
    validate on: nothing of the training stream is held out."""
    seq = cfg.train.seq_len
    tokens, held = (t if isinstance(t, ShardStream) or t.flags.writeable else t.copy()
                    for t in (tokens, held))  # fmt: skip
    train = whole_stream(len(tokens), seq)
    baseline = unigram_entropy(baseline_sample(tokens, train))
    return Corpus(TokenWindows(tokens, seq, train),
                  TokenWindows(held, seq, whole_stream(len(held), seq)), baseline)  # fmt: skip


def first_weights(cfg: Config) -> ValueSource:
    """Where the run's first weights come from: `--init-from`'s folder, else the seed; a
    LoRA run's adapters from `--adapter`'s PEFT folder, else the seed."""
    if cfg.train.init_from:
        base = hf_source(Path(cfg.train.init_from), cfg.model)
        if cfg.model.lora is None:
            return base
        folder = cfg.train.adapter
        adapters = adapter_source(Path(folder), cfg.model) if folder else None
        return with_adapters(base, cfg.model, cfg.train.seed, adapters)
    return seeded(cfg.model, cfg.train.seed)


def _streams_init(cfg: Config) -> bool:
    """ZeRO stage 3 initializes shard by shard, an NF4 base weight by weight: the full model
    is never materialized in full precision."""
    par = cfg.parallel
    return (par.zero == 3 or par.base_dtype == "nf4") and not par.two_bw


def _zero_engine(
    cfg: Config, model: Transformer, comm: Comm, pipeline: PipelineDriver | None
) -> ZeroEngine:
    par = cfg.parallel
    streamed = _streams_init(cfg)
    precision = parse_precision(par.precision, par.reduce_dtype, par.base_upcast)
    return ZeroEngine(
        model,
        comm,
        AdamW.from_train(cfg.train),
        stage=par.zero,
        precision=precision,
        offload=par.offload,
        offload_dir=par.offload_dir,
        bucket_mb=par.bucket_mb,
        isolate=tied_embedding_params(model) if pipeline else [],
        initial_value=source_values(model, first_weights(cfg)) if streamed else None,
        base_dtype=precision.param_dtype
        if par.base_upcast
        else parse_base_dtype(par.base_dtype, par.precision, cfg.model.lora is not None),
        plans=pipeline.plans if pipeline else None,
        reshard_after_forward=par.reshard_after_forward,
        axis=comm.mesh.replicas_axis,  # dp, or dp x cp: the ranks holding other tokens
        nf4=nf4_source(cfg.model, cfg.train.seed, cfg.train.init_from)
        if par.base_dtype == "nf4"
        else None,
    )


class Trainer:
    """One rank's share of a training run: `train_step()` runs the next optimizer step."""

    def __init__(self, cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.comm = Comm(mesh)
        self.corpus = corpus or load_corpus(cfg)
        t, par = cfg.train, cfg.parallel
        self.pipeline = (
            PipelineDriver(
                par, cfg.model, t.micro_batch, t.seq_len, cfg.accumulation, mesh, self.comm
            )
            if mesh.size("pp") > 1
            else None
        )
        model = build_model(cfg.model, mesh.device, t.seed, self._parallelize,
                            not _streams_init(cfg), first_weights(cfg))  # fmt: skip
        model.packed_attention = par.packed_attention  # models/packed_attention.py
        self.grad_rules = SplitGradRules.of(model, mesh)
        replica = (mesh.coord.dp, mesh.size("dp"))
        self.batches = StepBatches(
            self.corpus,
            t.global_batch,
            t.micro_batch,
            t.seed,
            replica,
            mesh.device,
            t.loss_average,
        )
        if mesh.size("cp") > 1:  # this rank's tokens of its replica's rows
            self.batches = ContextBatches(self.batches, self.comm, par.cp_exchange)
        self._model = model
        self.stream: TwoBWStream | None = None  # the 2BW runner, when the schedule is 2bw
        self.engine, runner = self._engine_and_runner(model)
        self._step = Step(self.engine, runner, self.grad_rules, self.comm, t)
        self.step = 0
        self.base = ckpt_base.base_record(cfg.to_dict())  # a LoRA run's frozen base, named
        self.best: dict[str, Any] | None = None  # --keep-best: {"step", "val_loss"} so far

    def _parallelize(self, model: Transformer) -> None:
        """On the meta model, in DESIGN's order: tensor parallel, then the pipeline split."""
        apply_tensor_parallel(model, self.mesh, self.comm, self.cfg.parallel.sequence_parallel)
        if self.pipeline:
            self.pipeline.prune(model)

    def _engine_and_runner(self, model: Transformer) -> tuple[OptimizerEngine, Runner]:
        """Recompute, then the engine that owns the gradients and the runner of the
        micro-batches, as the layout asks (docs/architecture.md has the table)."""
        cfg = self.cfg
        if cfg.parallel.two_bw:
            par = cfg.parallel
            versions = WeightVersions(
                model, cfg.train, self.comm, par.recompute, par.offload_activations
            )
            self.stream = TwoBWStream(self.pipeline, versions, self.batches, cfg.train.steps)
            return versions, self.stream
        apply_recompute(model, cfg.parallel.recompute)
        apply_partition_activations(model, self.comm, cfg.parallel.partition_activations)
        apply_activation_offload(model, cfg.parallel.offload_activations)
        if cfg.parallel.dp_mode == "naive":
            coordinator = Coordinator(model, cfg.train, self.comm)
            return coordinator, ScatterGather(model, coordinator, self.batches, self.comm)
        engine = _zero_engine(cfg, model, self.comm, self.pipeline)
        if self.pipeline is None:
            return engine, Accumulate(model, engine, self.batches)
        dtype = engine.precision.param_dtype
        self.pipeline.attach(model, engine, dtype, engine.pipeline_actions)
        return engine, Pipelined(self.pipeline, self.batches)

    @property
    def model(self) -> nn.Module:
        """This rank's part of the model with the newest weights (2BW: its latest version)."""
        return self.engine.current_model

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    def train_step(self, meter_activations: bool = False) -> StepResult:
        """One optimizer step over one global batch; returns the global mean loss.

        `meter_activations`: count the bytes autograd saves for backward during the step
        (the memory tracker's `activations` peak). Off by default: the hook on every saved
        tensor costs time (about 1 ms a step on the lessons' CPU models, 3-20% of their step,
        more the more is saved), and the step is the same code either way."""
        memory = self.engine.memory
        meter = memory.activations() if meter_activations and memory else nullcontext()
        with meter:
            result = self._step(self.step)
        self.step += 1
        return result

    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows, split across replicas."""
        batches = self.batches.validation(self.cfg.train.eval_batches)
        return evaluate_loss(self.model, batches, self.comm, self.pipeline)

    # -- checkpoints ---------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """What continues the run besides the tensors (the same on every rank). Dropout,
        LoRA's adapter dropout included, is keyed by (seed, step, sample)
        (models/dropout.py), so no random-generator state is needed. A LoRA run's tensors
        are its adapters alone (the engines save only trainable parameters) and "base" names
        the frozen base they need instead of copying it (checkpoint/base.py)."""
        scaler = self.engine.scaler.state_dict() if self.engine.scaler else None
        state = {
            "step": self.step,
            "sampler": self.batches.position(self.step),
            "engine_step": self.engine.step_count,
            "loss_scaler": scaler,
            "config": self.cfg.to_dict(),
        }
        if self.base is not None:
            state["base"] = self.base
        if self.best is not None:
            state["best"] = self.best
        return state

    def save(self, out: Path, before_commit: Callable[[], None] | None = None) -> dict[str, float]:
        """Write `out/checkpoints/step-N` (collective) and keep the newest ones."""
        path = store.step_dir(out, self.step)
        stats = ckpt_io.save(path, self.engine, self._model, self.grad_rules, self.comm,
                             self.trainer_state(), before_commit)  # fmt: skip
        if self.mesh.rank == 0:
            store.prune(out, self.cfg.train.keep_checkpoints)
        return {"path": str(path), **stats}

    def load(self, path: Path) -> None:
        """Continue from a checkpoint written under any layout (collective)."""
        state = store.read_trainer(path)
        ckpt_base.check_same_adapters_and_base(path, state, self.cfg.to_dict())
        state = self.load_weights(path)
        self.batches.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.best = state.get("best")
        if self.stream:  # 2BW: the stream goes on from the loaded versions
            self.stream.start_at(self.step)

    def load_weights(self, path: Path) -> dict[str, Any]:
        """The parameters and optimizer state of a checkpoint of any layout (collective), not
        where its run stood (`plait eval` reads other data); returns its trainer state."""
        state = store.read_trainer(path)
        ckpt_io.load(path, self.engine, self._model, self.comm, state)
        return state

    def close(self) -> None:
        self.engine.close()
