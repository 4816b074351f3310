"""Build one rank's share of a training run: `build_rank`, a recipe's setup in its order.

    corpus        which rows the run trains and validates on        build/corpus.py
    weights       where the first weights come from                 build/model.py
    model         built on the meta device, then parallelized:      build/model.py
                  tensor parallel (parallel/tp/apply.py), the pipeline stage split,
                  materialized and initialized (layout independent)
    engine        recomputation, then the optimizer engine (ZeRO stage 0-3, naive data
                  parallelism, or 2BW's two weight versions)
    runner        what executes a step's micro-batches: plain accumulation, a pipeline
                  schedule, or the asynchronous 2BW stream

Every choice follows from the configuration and the mesh; docs/architecture.md has the table
of engines and runners. Nothing here runs a step: the Trainer (train.py) does.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.build.corpus import load_corpus
from plait.build.model import FirstWeights, build_model, first_weights
from plait.comm import Comm
from plait.config import Config
from plait.context_batches import ContextBatches
from plait.data.batches import Corpus, StepBatches
from plait.mesh import Mesh
from plait.mixed_precision import parse_base_dtype, parse_precision
from plait.models.init import source_values
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
from plait.parallel.zero.options import ZeroOptions
from plait.step import Accumulate, Pipelined, Runner


@dataclass
class RankParts:
    """One rank's built parts. `model` is the model as built (the engine's `current_model`
    is what to run: 2BW's newest version); `pipeline` is None without one; `stream` is the
    runner when it is 2BW's stream (it restarts from a loaded step), else None."""

    comm: Comm
    corpus: Corpus
    model: Transformer
    grad_rules: SplitGradRules
    batches: StepBatches | ContextBatches
    pipeline: PipelineDriver | None
    engine: OptimizerEngine
    runner: Runner
    stream: TwoBWStream | None


def build_rank(cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> RankParts:
    """This rank's parts of the run `cfg` describes, built in the recipe's order (the module
    docstring); `corpus` replaces the one the configuration names (tests, `plait eval`)."""
    t, par = cfg.train, cfg.parallel
    comm = Comm(mesh)
    corpus = corpus or load_corpus(cfg)
    weights = first_weights(cfg)
    pipeline = None
    if mesh.size("pp") > 1:
        pipeline = PipelineDriver(par, cfg.model, t.micro_batch, t.seq_len, cfg.accumulation,
                                  mesh, comm)  # fmt: skip

    def parallelize(model: Transformer) -> None:
        """On the meta model: tensor parallel, then the pipeline split."""
        apply_tensor_parallel(model, mesh, comm, par.sequence_parallel)
        if pipeline:
            pipeline.prune(model)

    model = build_model(cfg.model, mesh.device, t.seed, parallelize, not weights.streamed,
                        weights.values)  # fmt: skip
    model.packed_attention = cfg.train.packed_attention  # models/packed_attention.py
    rules = SplitGradRules.of(model, mesh)
    replica = (mesh.coord.dp, mesh.size("dp"))
    batches = StepBatches(corpus, t.global_batch, t.micro_batch, t.seed, replica, mesh.device,
                          t.loss_average)  # fmt: skip
    if mesh.size("cp") > 1:  # this rank's tokens of its replica's rows
        batches = ContextBatches(batches, comm, par.cp_exchange)
    engine, runner = engine_and_runner(cfg, model, comm, pipeline, batches, weights)
    stream = runner if isinstance(runner, TwoBWStream) else None
    return RankParts(comm, corpus, model, rules, batches, pipeline, engine, runner, stream)


def engine_and_runner(
    cfg: Config,
    model: Transformer,
    comm: Comm,
    pipeline: PipelineDriver | None,
    batches: StepBatches | ContextBatches,
    weights: FirstWeights,
) -> tuple[OptimizerEngine, Runner]:
    """Recompute, then the engine that owns the gradients and the runner of the
    micro-batches, as the layout asks (docs/architecture.md has the table)."""
    par = cfg.parallel
    if par.two_bw:
        assert pipeline is not None  # configuration checks: 2BW is a pipeline schedule
        mem = cfg.memory
        versions = WeightVersions(model, cfg.optim, comm, mem.recompute, mem.offload_activations)
        return versions, TwoBWStream(pipeline, versions, batches, cfg.train.steps)
    apply_recompute(model, cfg.memory.recompute)
    apply_partition_activations(model, comm, cfg.memory.partition_activations)
    apply_activation_offload(model, cfg.memory.offload_activations)
    if par.dp_mode == "naive":
        coordinator = Coordinator(model, cfg.optim, comm)
        return coordinator, ScatterGather(model, coordinator, batches, comm)
    options = zero_options(cfg, model, comm, pipeline, weights)
    engine = ZeroEngine(model, comm, AdamW.from_optim(cfg.optim), options)
    if pipeline is None:
        return engine, Accumulate(model, engine, batches)
    pipeline.attach(model, engine, engine.precision.param_dtype, engine.pipeline_actions)
    return engine, Pipelined(pipeline, batches)


def zero_options(
    cfg: Config,
    model: Transformer,
    comm: Comm,
    pipeline: PipelineDriver | None,
    weights: FirstWeights,
) -> ZeroOptions:
    """The ZeRO engine's settings for this run: the configuration's, the pipeline's stages
    and tied embeddings, and the first weights when the engine fills its own shards."""
    par = cfg.parallel
    precision = parse_precision(cfg.train.precision, cfg.train.reduce_dtype, cfg.lora.base_upcast)
    base = parse_base_dtype(cfg.lora.base_dtype, cfg.train.precision, cfg.model.lora is not None)
    return ZeroOptions(
        stage=cfg.memory.zero,
        precision=precision,
        offload=cfg.memory.offload,
        offload_dir=cfg.memory.offload_dir,
        bucket_mb=par.bucket_mb,
        isolate=tied_embedding_params(model) if pipeline else (),
        initial_value=source_values(model, weights.values) if weights.streamed else None,
        base_dtype=precision.param_dtype if cfg.lora.base_upcast else base,
        plans=pipeline.plans if pipeline else None,
        reshard_after_forward=cfg.memory.reshard_after_forward,
        axis=comm.mesh.replicas_axis,  # dp, or dp x cp: the ranks holding other tokens
        nf4=weights.nf4,
    )
