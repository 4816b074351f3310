"""Which options combine: the composition rules of layouts, ZeRO, precision and schedules.

Pure (no process, no model, no engine): `config/checks.py` calls these before any worker starts,
and the engines call the ones that guard their own arguments, so each rule is written once
and a wrong combination fails with one message naming the values, wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.errors import ConfigError
from plait.mixed_precision import parse_precision
from plait.models.architecture import ModelConfig
from plait.models.packed_attention import MODES, varlen_refusal
from plait.schedule.schedules import build_schedule, two_bw
from plait.schedule.stages import split_layers

RECOMPUTE_MODES = ("none", "full", "selective")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")
ACTIVATION_OFFLOADS = ("none", "cpu")
RESHARD_AFTER_FORWARD = ("default", "always", "never")


def check_recompute(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {mode!r}")


def check_activation_offload(target: str) -> None:
    """An offload target that exists."""
    if target not in ACTIVATION_OFFLOADS:
        raise ConfigError(
            f"offload-activations must be one of {', '.join(ACTIVATION_OFFLOADS)}; got {target!r}"
        )


def check_partition_activations(
    enabled: bool, tp: int, recompute: str, sequence_parallel: bool, two_bw: bool
) -> None:
    """ZeRO-R's partitioned activations split what tensor parallelism replicates: the input
    each block saves for its recomputation. So they need tp > 1 and a recompute mode, have
    nothing left to split under sequence parallelism, and do not reach 2BW's block copies."""
    if not enabled:
        return
    if tp == 1:
        raise ConfigError(
            "--partition-activations splits each block's saved input over the tensor-parallel "
            "ranks: it needs tp > 1; got tp=1"
        )
    if recompute == "none":
        raise ConfigError(
            "--partition-activations partitions the block inputs that recomputation keeps: "
            "it needs --recompute full or selective; got --recompute none"
        )
    if sequence_parallel:
        raise ConfigError(
            f"--partition-activations does not combine with --sequence-parallel (tp={tp}): "
            "sequence parallelism already holds the block inputs sharded over tp"
        )
    if two_bw:
        raise ConfigError(
            "--partition-activations does not combine with --schedule 2bw (its weight "
            "versions run copies of the blocks); use another schedule"
        )


def check_tensor_parallel(
    model: ModelConfig, tp: int, sequence_parallel: bool = False, seq_len: int | None = None
) -> None:
    """`model` splits `tp` ways: heads and MLP columns divide, and sequences under SP. The
    vocabulary needs no check: it is padded to a multiple of tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    if sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel needs tp > 1")
    needs = [
        ("model.n_heads", model.n_heads, "query heads are split across tp ranks"),
        ("model.n_kv_heads", model.kv_heads, "key/value heads are split across tp ranks"),
        ("MLP hidden size (model.ffn_hidden)", model.ffn_dim, "its columns are split"),
    ]
    for name, value, why in needs:
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by tp={tp} ({why})")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by tp={tp} "
            "(sequence parallelism splits every sequence across tp ranks)"
        )


def check_pipeline(
    n_layers: int,
    pp: int,
    schedule: str,
    virtual_stages: int,
    microbatches: int,
    stage_layers: Sequence[int] | None = None,
) -> None:
    """The schedule exists for (pp, microbatches, virtual stages) and the layers split."""
    if pp == 1:
        if virtual_stages != 1:
            raise ConfigError(f"virtual_stages={virtual_stages} needs pp > 1")
        if schedule != "1f1b":  # the default: anything else was asked for, and would be ignored
            raise ConfigError(f"schedule {schedule!r} needs a pipeline (pp > 1); got pp=1")
        if stage_layers is not None:
            raise ConfigError(f"stage_layers {list(stage_layers)} needs a pipeline (pp > 1)")
        return
    if schedule == "2bw":
        check_two_bw(pp, microbatches, virtual_stages)
    build_schedule(schedule, pp, microbatches, virtual_stages)
    split_layers(n_layers, pp * virtual_stages, stage_layers)


def check_two_bw(pp: int, microbatches: int, virtual_stages: int) -> None:
    """PipeDream-2BW streams one non-interleaved schedule (m >= p)."""
    if virtual_stages != 1:
        raise ConfigError(f"schedule 2bw does not interleave: got virtual_stages={virtual_stages}")
    two_bw(pp, microbatches, 1)


def check_zero(
    stage: int,
    offload: str,
    offload_dir: str | None,
    pp: int = 1,
    precision: str = "fp32",
    reduce_dtype: str | None = None,
    schedule: str = "1f1b",
) -> None:
    """A ZeRO stage, offload and precision that exist and combine with the pipeline."""
    if stage not in ZERO_STAGES:
        raise ConfigError(f"zero stage must be 0, 1, 2 or 3; got {stage!r}")
    if offload not in OFFLOADS:
        raise ConfigError(f"offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if offload == "nvme" and not offload_dir:
        raise ConfigError("offload 'nvme' needs a directory for the state files (--offload-dir)")
    if offload != "nvme" and offload_dir:
        raise ConfigError(f"--offload-dir {offload_dir!r} is only used with --offload nvme")
    parse_precision(precision, reduce_dtype)
    sharded_or_mixed = stage > 0 or precision != "fp32" or offload != "none"
    if pp > 1 and schedule == "2bw" and sharded_or_mixed:
        raise ConfigError(
            f"schedule 2bw keeps its own two weight versions and optimizer; it does not run "
            f"on the ZeRO engine (got zero={stage}, precision={precision}, "
            f"offload={offload}; use zero=0, fp32 and no offload)"
        )


def check_reshard(value: str, stage: int, pp: int) -> None:
    """`--reshard-after-forward` (torchtitan's name and values for FSDP's option): default
    keeps a pipeline stage's ZeRO-3 parameters gathered through the step and regathers per
    block without a pipeline (as today); always regathers per micro-batch under a pipeline
    too; never needs a pipeline (without one, plait's ZeRO-3 frees each block after use)."""
    if value not in RESHARD_AFTER_FORWARD:
        raise ConfigError(
            f"reshard-after-forward must be one of {', '.join(RESHARD_AFTER_FORWARD)}; "
            f"got {value!r}"
        )
    if value != "default" and stage != 3:
        raise ConfigError(f"--reshard-after-forward {value} needs --zero 3; got zero={stage}")
    if value == "never" and pp == 1:
        raise ConfigError(
            "--reshard-after-forward never needs a pipeline (pp > 1): without one ZeRO-3 "
            "gathers each block around its forward and its backward"
        )


DP_MODES = ("ddp", "naive")


def check_dp_mode(mode: str, tp: int, pp: int, zero: int, precision: str, offload: str) -> None:
    """Naive data parallelism is the course's baseline: plain replicas, fp32, nothing else."""
    if mode not in DP_MODES:
        raise ConfigError(f"dp_mode must be one of {', '.join(DP_MODES)}; got {mode!r}")
    if mode == "naive" and (tp, pp, zero, precision, offload) != (1, 1, 0, "fp32", "none"):
        raise ConfigError(
            f"dp_mode naive is plain data parallelism with one coordinator: it needs tp=1, "
            f"pp=1, zero=0, precision fp32 and no offload; got tp={tp}, pp={pp}, zero={zero}, "
            f"precision={precision}, offload={offload}"
        )


def check_packed_attention(mode: str, device: str, precision: str, dropout: float) -> None:
    """A packed-attention mode that exists and can run here (models/packed_attention.py):
    varlen needs CUDA, a 16-bit precision and a torch that has varlen_attn; by document
    (per-document, varlen) no attention dropout, which needs the mask path's probabilities."""
    if mode not in MODES:
        raise ConfigError(f"packed_attention must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "varlen":
        refusal = varlen_refusal(device, parse_precision(precision).param_dtype)
        if refusal is not None:
            raise ConfigError(
                f"--packed-attention varlen cannot run: {refusal}; give auto (per-document "
                "here) or mask"
            )
    if mode in ("per-document", "varlen") and dropout > 0:
        raise ConfigError(
            f"--packed-attention {mode} cannot apply dropout {dropout}: keyed attention dropout "
            "needs the whole (b, a, s, s) probabilities of the mask path; give auto, mask or "
            "--dropout 0"
        )


CP_EXCHANGES = ("allgather", "ring")


def check_context_parallel(
    cp: int, exchange: str, seq_len: int, tp: int, sequence_parallel: bool, pp: int,
    schedule: str, dp_mode: str, model: ModelConfig,
) -> None:  # fmt: skip
    """Context parallelism (parallel/cp) holds seq_len / cp tokens of every row per rank, so
    cp divides the row length, and under sequence parallelism tp divides each rank's share;
    the exchange is one that exists; the layouts it does not reach are refused by name."""
    if exchange not in CP_EXCHANGES:
        raise ConfigError(f"cp_exchange must be one of {', '.join(CP_EXCHANGES)}; got {exchange!r}")
    if cp == 1:
        return
    if seq_len % cp:
        raise ConfigError(
            f"--cp {cp} does not divide the row length --seq-len {seq_len}: every "
            "context-parallel rank holds seq_len / cp tokens of each row"
        )
    if sequence_parallel and (seq_len // cp) % tp:
        raise ConfigError(
            f"--cp {cp} leaves {seq_len // cp} tokens of each row per rank (--seq-len "
            f"{seq_len}), which sequence parallelism cannot split over tp={tp}"
        )
    if pp > 1 and schedule == "2bw":
        raise ConfigError(
            f"--cp {cp} does not combine with --schedule 2bw: its weight versions reduce "
            "gradients over dp alone; give a synchronous schedule (1f1b, gpipe, ...)"
        )
    refused = {
        "--dp-mode naive": dp_mode == "naive",
        f"--dropout {model.dropout}": model.dropout > 0,
        # the exchange's rule is the block-causal one: a window, a soft cap or another
        # score scale (Mistral's, Gemma's) is not carried to the other ranks' keys yet
        f"--sliding-window {model.sliding_window}": model.sliding_window is not None,
        f"--attn-softcap {model.attn_softcap}": model.attn_softcap is not None,
        f"--attn-scalar {model.attn_scalar}": model.attn_scalar is not None,
    }
    for flag, hit in refused.items():
        if hit:
            raise ConfigError(f"--cp {cp} does not combine with {flag} yet; give --cp 1")
