"""The sections of a run's configuration that say where the work runs and what it holds:
[parallel] (how the work is split), [memory] (what is sharded, offloaded or recomputed to
fit) and [lora] (everything low-rank adaptation needs, in one place).

Each field's `metadata["help"]` is its flag's help and `metadata["domain"]` its numeric
range (`plait.domain`); a field's flag is `--` + its name unless `metadata["flag"]` says
otherwise (the [lora] fields keep their `--lora-*` flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.domain import Domain, OrAuto, above, at_least, fraction
from plait.errors import ConfigError
from plait.topology import Layout


@dataclass(slots=True)
class ParallelConfig:
    """How the work is split across processes."""

    dp: int = field(
        default=1,
        metadata={
            "domain": OrAuto(int, 1),
            "help": "data-parallel replicas; auto: under torchrun or srun, the world / (tp x pp)",
        },
    )
    pp: int = field(
        default=1, metadata={"domain": at_least(1), "help": "pipeline-parallel stages (ranks)"}
    )
    tp: int = field(
        default=1,
        metadata={"domain": at_least(1), "help": "tensor-parallel ranks (Megatron style)"},
    )
    cp: int = field(
        default=1,
        metadata={
            "domain": at_least(1),
            "help": "context-parallel ranks: each packed document cut into 2 x cp pieces, "
            "rank r holding pieces r and 2cp-1-r; attention exchanges keys and values",
        },
    )
    cp_exchange: str = field(
        default="allgather",
        metadata={
            "help": "context parallel: allgather (each layer's keys and values gathered) or "
            "ring (passed rank to rank, merged by log-sum-exp)"
        },
    )
    sequence_parallel: bool = field(
        default=False, metadata={"help": "tensor parallel: shard norms/dropout by sequence"}
    )
    dp_mode: str = field(
        default="ddp",
        metadata={
            "help": "data parallelism: ddp (bucketed all-reduce overlapped with backward) or "
            "naive (rank 0 scatters inputs, gathers logits, steps alone)"
        },
    )
    schedule: str = field(
        default="1f1b",
        metadata={"help": "pipeline schedule: naive, gpipe, 1f1b, interleaved, zb-h1, 2bw"},
    )
    virtual_stages: int = field(
        default=1,
        metadata={
            "domain": at_least(1),
            "help": "model chunks per pipeline rank (interleaved schedule)",
        },
    )
    microbatches: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "micro-batches per step; sets micro-batch = global / (dp x this)",
        },
    )
    stage_layers: str = field(
        default="", metadata={"help": "layers per pipeline stage, e.g. '3,3,2'; default even"}
    )
    bucket_mb: float = field(
        default=25.0, metadata={"domain": above(0), "help": "gradient bucket size in MiB"}
    )
    comm_timeout: float = field(
        default=300.0,
        metadata={"domain": above(0), "help": "seconds before a stalled collective raises"},
    )

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp)

    @property
    def two_bw(self) -> bool:
        """The asynchronous PipeDream-2BW stream, rather than a step-by-step schedule."""
        return self.pp > 1 and self.schedule == "2bw"

    def stage_layer_counts(self) -> list[int] | None:
        """`stage_layers` as numbers, or None for an even split."""
        if not self.stage_layers.strip():
            return None
        try:
            return [int(x) for x in self.stage_layers.split(",")]
        except ValueError:
            raise ConfigError(
                f"stage_layers must be comma-separated integers, got {self.stage_layers!r}"
            ) from None


@dataclass(slots=True)
class MemoryConfig:
    """What is sharded, offloaded or recomputed so a step fits: ZeRO (DeepSpeed's
    zero_optimization), optimizer offload, activation recomputation, offload and partitioning
    (DeepSpeed's activation_checkpointing, torchtitan's [activation_checkpoint])."""

    zero: int = field(
        default=0,
        metadata={
            "domain": Domain(int, 0, 3),
            "help": "ZeRO stage: 0 replicate, 1 optimizer states, 2 +grads, 3 +params",
        },
    )
    reshard_after_forward: str = field(
        default="default",
        metadata={
            "help": "ZeRO-3 under a pipeline: default or never (a stage's parameters gathered "
            "once per step, kept through its micro-batches), always (regathered per "
            "micro-batch and block: less memory, m times the all-gathers)"
        },
    )
    offload: str = field(
        default="none", metadata={"help": "optimizer states and master weights: none, cpu, nvme"}
    )
    offload_dir: str | None = field(
        default=None, metadata={"help": "folder for --offload nvme state files"}
    )
    recompute: str = field(
        default="none", metadata={"help": "activation recomputation: none, full or selective"}
    )
    offload_activations: str = field(
        default="none",
        metadata={
            "help": "where the tensors a block saves for backward wait: none (device) or cpu "
            "(host memory; with recompute only the checkpointed block inputs move)"
        },
    )
    partition_activations: bool = field(
        default=False,
        metadata={
            "help": "tensor parallel with recompute: hold each block's saved input 1/tp per "
            "rank and all-gather it in backward (ZeRO-R partitioned activations)"
        },
    )


@dataclass(slots=True)
class LoRAConfig:
    """Low-rank adaptation (docs/lora.md): the adapters' shape, the frozen base's dtype and
    a PEFT adapter folder to start from. The model's own record of its adapters
    (`ModelConfig.lora_*`, which the network is built from and checkpoints keep) is set
    from this section when the config is built (`plait.config.schema.build_config`)."""

    rank: int | None = field(
        default=None,
        metadata={
            "domain": at_least(1),
            "flag": "--lora-rank",
            "help": "LoRA rank r: freeze the base, train adapters (docs/lora.md); default off",
        },
    )
    alpha: float = field(
        default=8.0,
        metadata={
            "domain": above(0),
            "flag": "--lora-alpha",
            "help": "LoRA alpha: the update is scaled by alpha / r",
        },
    )
    dropout: float = field(
        default=0.0,
        metadata={
            "domain": fraction(),
            "flag": "--lora-dropout",
            "help": "dropout on the adapters' input",
        },
    )
    targets: str = field(
        default="",
        metadata={
            "flag": "--lora-targets",
            "help": "LoRA targets: q,k,v,o,gate,up,down or attn, mlp, all; default PEFT's "
            "(LLaMA q,v; GPT-2 c_attn = q,k,v)",
        },
    )
    base_dtype: str = field(
        default="auto",
        metadata={
            "help": "how a LoRA run holds its frozen base: auto (the precision's parameter "
            "dtype), bf16, fp16, fp32, or nf4 (QLoRA: the blocks' Linear weights in 4-bit "
            "NormalFloat, the rest in the precision's dtype); adapters keep fp32 masters"
        },
    )
    base_upcast: bool = field(
        default=False,
        metadata={
            "help": "QLoRA as PEFT's prepare_model_for_kbit_training: the base's unquantized "
            "weights (embeddings, head, norms), the activations and the adapters in fp32, "
            "only the NF4 products in --precision's dtype (with --base-dtype nf4, bf16/fp16)"
        },
    )
    adapter: str = field(
        default="",
        metadata={
            "help": "with --init-from: start from a PEFT LoRA adapter folder (its rank, alpha, "
            "dropout, targets and weights)"
        },
    )


MODEL_LORA = {"rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout",
              "targets": "lora_targets"}  # fmt: skip
"""[lora] fields -> the ModelConfig fields that record them on the model."""
