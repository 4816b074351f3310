"""Which layouts to consider: the axes that divide the model, the GPUs and the batch.

A *shape* fixes how the work is cut (tp, pp, dp, schedule, virtual stages, micro-batch);
its *knobs* (ZeRO stage, offload, recompute, sequence parallelism, activation offload) trade
memory for time
without changing the cut. Only balanced cuts are listed: tp divides the heads, key/value
heads and MLP columns and stays within a node (its collectives are the busiest); pp x v
divides the layers (plait also runs uneven splits, `--stage-layers`, which a plan does not
propose); dp divides the global batch. Which combinations run at all is `composition.py`'s call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from plait.composition import check_tensor_parallel, check_zero
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.nf4.checks import check_slices

INTERLEAVE = (2, 4)  # virtual stages an interleaved schedule is offered with
FRUGAL = {"none": 0, "selective": 1, "full": 2, "cpu": 1, "nvme": 2, "default": 0, "always": 1}
"""How much device memory an offload, recompute or ZeRO-3 pipeline setting (regathering per
micro-batch: `--reshard-after-forward always`) saves, in order (none saves none)."""
GPIPE_UP_TO = 3  # gpipe holds every micro-batch: offered for m <= 3p only (1F1B's bubble)


@dataclass(frozen=True)
class Request:
    """What `plait plan` was asked: the model, the machine, the batch, fixed axes."""

    model: ModelConfig
    preset: str
    gpus: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    precision: str
    max_micro_batch: int = 8
    offload_dir: str | None = None
    fixed: tuple[tuple[str, int], ...] = ()  # ("tp", 2): axes the user pinned
    base_dtype: str = "auto"  # how a LoRA run (model.lora_rank set) holds its frozen base

    def pinned(self, axis: str) -> int | None:
        return dict(self.fixed).get(axis)


@dataclass(frozen=True)
class Candidate:
    """One layout: a shape and its knobs, as `plait train` flags."""

    dp: int
    tp: int
    pp: int
    schedule: str
    virtual_stages: int
    micro_batch: int
    zero: int = 0
    offload: str = "none"
    recompute: str = "none"
    sequence_parallel: bool = False
    offload_activations: str = "none"
    reshard: str = "default"  # ZeRO-3 under a pipeline: kept through the step, or "always"

    @property
    def shape(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.schedule, self.virtual_stages, self.micro_batch)

    def overrides(self, req: Request) -> dict[str, dict[str, Any]]:
        """The config sections this layout sets (`build_config`'s overrides)."""
        par: dict[str, Any] = {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "sequence_parallel": self.sequence_parallel,
        }
        memory: dict[str, Any] = {
            "zero": self.zero,
            "offload": self.offload,
            "recompute": self.recompute,
            "offload_activations": self.offload_activations,
        }
        if self.pp > 1:
            par |= {"schedule": self.schedule, "virtual_stages": self.virtual_stages}
        if self.reshard != "default":
            memory["reshard_after_forward"] = self.reshard
        if self.offload == "nvme":
            memory["offload_dir"] = req.offload_dir
        train = {
            "global_batch": req.global_batch,
            "micro_batch": self.micro_batch,
            "seq_len": req.seq_len,
            "precision": req.precision,
        }
        over = {"parallel": par, "memory": memory, "train": train}
        if req.model.lora is not None:
            over["lora"] = {"base_dtype": req.base_dtype}
        return over

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")]
        parts.append(f"pp{self.pp}")
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(self.schedule + v)
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}"]
        if self.reshard == "always":
            parts.append("regather")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute}")
        if self.offload_activations != "none":
            parts.append(f"activations {self.offload_activations}")
        return " ".join(parts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_sizes(req: Request) -> list[int]:
    """tp values that split the model and stay within a node."""
    out = []
    for t in divisors(req.gpus):
        try:
            check_tensor_parallel(req.model, t)
            if req.base_dtype == "nf4" and t > 1:
                check_slices(req.model, t)  # whole NF4 blocks on every rank
        except ConfigError:
            continue
        if t <= req.gpus_per_node:
            out.append(t)
    return out


def pp_sizes(req: Request, rest: int) -> list[int]:
    return [p for p in divisors(rest) if req.model.n_layers % p == 0]


def _schedules(req: Request, pp: int, m: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    yield "1f1b", 1
    yield "zb-h1", 1
    if m <= GPIPE_UP_TO * pp:
        yield "gpipe", 1
    for v in INTERLEAVE:
        if req.model.n_layers % (pp * v) == 0 and m % pp == 0:
            yield "interleaved", v
    if req.precision == "fp32" and m >= pp:
        yield "2bw", 1


def shapes(req: Request) -> Iterator[Candidate]:
    """Every balanced cut of the model over `gpus` GPUs (pinned axes respected)."""
    for tp in tp_sizes(req):
        for pp in pp_sizes(req, req.gpus // tp):
            dp = req.gpus // (tp * pp)
            axes = {"tp": tp, "pp": pp, "dp": dp}
            if any(axes[a] != v for a, v in req.fixed) or req.global_batch % dp:
                continue
            per_replica = req.global_batch // dp
            for mb in (b for b in divisors(per_replica) if b & (b - 1) == 0):
                if mb > req.max_micro_batch:
                    continue
                for name, v in _schedules(req, pp, per_replica // mb):
                    yield Candidate(dp, tp, pp, name, v, mb)


def knobs(req: Request, shape: Candidate, offload_activations: bool = True) -> list[Candidate]:
    """The shape with every ZeRO stage, offload, recompute, SP and activation offload setting
    plait accepts (`offload_activations` False: not offered, where the host is the device)."""
    offloads = ["none", "cpu"] + (["nvme"] if req.offload_dir else [])
    # Sequence parallelism moves the same bytes as tp alone (all-gather + reduce-scatter =
    # all-reduce in the ring model) and holds less: with tp it is on wherever seq divides.
    sp = shape.tp > 1 and req.seq_len % shape.tp == 0
    out = []
    for zero in (0, 1, 2, 3):
        for off in offloads:
            try:
                check_zero(
                    zero,
                    off,
                    req.offload_dir if off == "nvme" else None,
                    shape.pp,
                    req.precision,
                    None,
                    shape.schedule,
                )
            except ConfigError:
                continue
            if shape.dp == 1 and zero > 0:
                continue  # nothing to shard over one replica
            if req.base_dtype == "nf4" and shape.schedule == "2bw":
                continue  # an NF4 base is held by the ZeRO engine, not 2BW's versions
            # ZeRO-3 under a pipeline: the stage kept gathered through the step, or not.
            reshards = ("default", "always") if zero == 3 and shape.pp > 1 else ("default",)
            for rc in ("none", "selective", "full"):
                for act in ("none", "cpu") if offload_activations else ("none",):
                    out += [
                        replace(shape, zero=zero, offload=off, recompute=rc,
                                sequence_parallel=sp, offload_activations=act, reshard=again)
                        for again in reshards
                    ]  # fmt: skip
    return out


def most_frugal(options: list[Candidate]) -> Candidate:
    """The knobs that need the least device memory: ZeRO highest, offloaded, full recompute,
    sequence parallel, activations offloaded (memory falls with each of them)."""
    return max(
        options,
        key=lambda c: (
            c.zero,
            FRUGAL[c.offload],
            FRUGAL[c.recompute],
            c.sequence_parallel,
            FRUGAL[c.offload_activations],
            FRUGAL[c.reshard],
        ),
    )
