"""Published training runs on GPUs, and what the step-time model predicts for each (pure).

Each row is a run someone published with its model, hardware, layout and throughput: the
torchtitan team's Llama 3.1 8B on 8 H100s, Megatron-LM's H100 weak-scaling table and Meta's
LLaMA-65B on 2048 A100s (docs/planning.md cites each source and says what was assumed where
a source is silent). `predict` evaluates plait's step-time model (`step_time`) on the run's
exact layout: as plait runs it (tensor-parallel collectives synchronous, ZeRO-1's parameter
all-gather after the step), and with the communication the publishing framework overlaps
by its published flags taken out. `implied_achievable` solves for the compute rate a row
measured; the H100 profile's `achievable` is their median over Megatron's rows without a
pipeline (whose layout is published whole: no schedule to assume) but the held-back one
(`HELD_BACK`), which is reported apart as the check.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from plait.config import Config, build_config
from plait.models.architecture import ModelConfig
from plait.models.presets import get_preset
from plait.models.transformer import matmul_flops_per_token
from plait.plan.hardware import Hardware, load_hardware
from plait.plan.step_time import Memo, StepTime, step_time

TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Table 1)"
MEGATRON = "NVIDIA/Megatron-LM README.md, images/model_table.png (2024-07-15)"
LLAMA = "Touvron et al. 2023, LLaMA (arXiv:2302.13971), via ai-papers.xuzou.cn/papers/llama_2023"
HELD_BACK = "megatron-7.1b"
"""The Megatron row left out of the fit of the H100 profile's `achievable` (the check)."""


def megatron_gpt(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """A model of Megatron-LM's H100 table: vocabulary 131,072, sequences of 4,096 (the
    README's benchmark configuration), ffn 4h, multi-head attention, untied embedding and
    head (12Lh^2 + 2Vh gives the table's sizes: 1.74B for the 1.7B row, 7.11B for 7.1B)."""
    return dict(vocab_size=131072, n_layers=layers, d_model=hidden, n_heads=heads,
                ffn_hidden=4 * hidden, max_seq_len=4096, norm="layernorm", mlp="gelu",
                pos="rope", tie_embeddings=False, bias=False)  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what it trained where, its layout, and its throughput."""

    key: str
    label: str
    source: str
    preset: str  # a plait preset, or "" with `shape` giving the hyper-parameters
    hardware: str  # a shipped profile
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    tokens_per_gpu: float = 0.0  # published tokens/s/GPU (0: derived from tflops_per_gpu)
    tflops_per_gpu: float = 0.0  # published model TFLOP/s per GPU (Megatron's table)
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"  # "best": not published, the fastest plait offers (SCHEDULES)
    virtual_stages: int = 1
    overlapped: tuple[str, ...] = ()  # StepTime terms the framework hides, by its flags
    band: float = 0.15  # the stated band: |predicted / published - 1| at most this
    shape: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def model(self) -> ModelConfig:
        return get_preset(self.preset) if self.preset else ModelConfig(**self.shape)

    def config(self) -> Config:
        par: dict[str, Any] = dict(dp=self.dp, tp=self.tp, pp=self.pp,
                                   sequence_parallel=self.tp > 1)  # fmt: skip
        if self.pp > 1:
            par |= {"schedule": self.schedule, "virtual_stages": self.virtual_stages}
        train = dict(global_batch=self.global_batch, micro_batch=self.micro_batch,
                     seq_len=self.seq_len, precision="bf16")  # fmt: skip
        memory = {"zero": self.zero, "recompute": self.recompute}
        model = self.model()
        over = {"parallel": par, "memory": memory, "train": train}
        cfg = build_config(self.preset or "tiny-gpt", over, model)
        cfg.model = model
        cfg.validate()
        return cfg

    def published_tokens(self) -> float:
        """Tokens/s/GPU as published, or Megatron's TFLOP/s over the model FLOPs per token
        (its formula then was 6N + 12Lsh, plait's `matmul_flops_per_token`)."""
        if self.tokens_per_gpu:
            return self.tokens_per_gpu
        return self.tflops_per_gpu * 1e12 / matmul_flops_per_token(self.model(), self.seq_len)


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, batch: int,
              tflops: float) -> PublishedRun:  # fmt: skip
    """A row of Megatron-LM's table: dp 48 throughout, the distributed optimizer (ZeRO-1,
    which `--overlap-param-gather` needs), sequence parallelism (which `--tp-comm-overlap`
    needs); tp, dp and the parameter gather overlapped by the published flags. Micro-batch,
    schedule and recomputation are not published: micro-batch 1, no recomputation, and the
    fastest schedule plait offers for the pipeline (`best_schedule`)."""
    return PublishedRun(
        f"megatron-{size.lower()}", f"Megatron-LM GPT {size}", MEGATRON, "", "h100", 8, 48,
        tp, pp, batch, 4096, tflops_per_gpu=tflops, overlapped=("tp", "dp"),
        schedule="best" if pp > 1 else "1f1b", shape=megatron_gpt(layers, hidden, heads),
    )  # fmt: skip


def published_runs() -> list[PublishedRun]:
    """Every published row (rebuilt on each call: no module-level mutable state)."""
    titan = dict(source=TITAN, preset="llama3-8b", hardware="h100", gpus_per_node=8, dp=8,
                 tp=1, pp=1, global_batch=16, seq_len=8192, micro_batch=2, zero=3,
                 recompute="selective", overlapped=("dp",), band=0.35,
                 note="500 W H100s with HBM2e, slower than the SXM profile (the source's "
                 "footnote); op-level SAC recomputes every other matmul, plait's "
                 "selective only attention")  # fmt: skip
    eager = PublishedRun("torchtitan-8b", "torchtitan Llama 3.1 8B, FSDP",
                         tokens_per_gpu=5762, **titan)  # fmt: skip
    compiled = PublishedRun("torchtitan-8b-compile", "torchtitan Llama 3.1 8B, FSDP + compile",
                            tokens_per_gpu=6667, **titan)  # fmt: skip
    llama = PublishedRun("llama-65b", "LLaMA-65B (Meta)", LLAMA, "llama-65b", "a100", 8,
                         256, 8, 1, 2048, 2048, tokens_per_gpu=380, micro_batch=4, zero=3,
                         note="layout not in the source as read: plait plan's best with "
                         "tp 8 (within a node) when this table was made")  # fmt: skip
    return [
        eager,
        compiled,
        _megatron("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
        _megatron("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
        _megatron("16B", 48, 6144, 32, 4, 1, 192, 489.1),
        _megatron("32B", 56, 7168, 48, 8, 1, 192, 459.6),
        _megatron("70B", 64, 8192, 84, 8, 2, 384, 419.7),
        _megatron("119B", 80, 10240, 92, 8, 4, 768, 420.5),
        _megatron("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
        _megatron("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
        _megatron("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
        llama,
    ]


@dataclass(frozen=True)
class Prediction:
    """plait's prediction for one published run."""

    run: PublishedRun
    time: StepTime  # as plait runs the layout
    hidden: float  # seconds of it the publishing framework overlaps (its `overlapped` terms)
    flops_per_token: int

    @property
    def step(self) -> float:
        """The step time with the framework's overlapped communication hidden."""
        return self.time.total - self.hidden

    def tokens_per_gpu(self, step: float | None = None) -> float:
        r = self.run
        return r.global_batch * r.seq_len / (step or self.step) / r.gpus

    def mfu(self, hw: Hardware, step: float | None = None) -> float:
        return self.tokens_per_gpu(step) * self.flops_per_token / hw.peak_flops

    @property
    def ratio(self) -> float:
        """Predicted over published tokens/s/GPU (> 1: plait is optimistic)."""
        return self.tokens_per_gpu() / self.run.published_tokens()


SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4))
"""What `plait plan` offers a pipeline (interleaved where pp x v divides the layers)."""


def best_schedule(run: PublishedRun, hw: Hardware) -> PublishedRun:
    """`run` with its unpublished schedule ("best") set to the fastest plait offers."""
    if run.schedule != "best":
        return run
    layers = run.model().n_layers
    options = [replace(run, schedule=s, virtual_stages=v) for s, v in SCHEDULES
               if layers % (run.pp * v) == 0]  # fmt: skip
    return min(options, key=lambda r: predict(r, hw).step)


def predict(run: PublishedRun, hw: Hardware | None = None) -> Prediction:
    """plait's step-time model on the run's exact layout (module doc)."""
    hw = hw or load_hardware(run.hardware)
    run = best_schedule(run, hw)
    cfg = run.config()
    t = step_time(cfg, hw, run.gpus_per_node, Memo())
    hidden = sum(getattr(t, k) for k in run.overlapped)
    return Prediction(run, t, hidden, matmul_flops_per_token(cfg.model, run.seq_len))


def implied_achievable(run: PublishedRun, hw: Hardware) -> float:
    """The `achievable` at which the prediction (framework overlap taken out) equals the
    published throughput: the compute rate the run measured, net of the bubble, optimizer
    and small collectives the model adds. Bisection: the step falls as `achievable` grows."""
    want, lo, hi = run.published_tokens(), 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        got = predict(run, replace(hw, achievable=mid)).tokens_per_gpu()
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return (lo + hi) / 2


def fit_rows() -> list[PublishedRun]:
    """The rows the H100 `achievable` is fitted to: Megatron's without a pipeline (their
    layout is published whole), less `HELD_BACK`."""
    return [r for r in published_runs()
            if r.source == MEGATRON and r.pp == 1 and r.key != HELD_BACK]  # fmt: skip


def fitted_achievable(hw: Hardware) -> float:
    """The median implied `achievable` of `fit_rows()` on `hw` (its other figures as they are)."""
    return statistics.median(implied_achievable(r, hw) for r in fit_rows())


def _layout(r: PublishedRun) -> str:
    parts = [f"dp{r.dp} tp{r.tp}" + ("+sp" if r.tp > 1 else "") + f" pp{r.pp}"]
    v = f" v{r.virtual_stages}" if r.virtual_stages > 1 else ""
    parts += [r.schedule + v] if r.pp > 1 else []
    parts += [f"mb{r.micro_batch}", f"zero{r.zero}"]
    parts += [f"recompute {r.recompute}"] if r.recompute != "none" else []
    return " ".join(parts)


def _role(r: PublishedRun) -> str:
    if r.key == HELD_BACK:
        return "held back (the check)"
    return "fitted" if r in fit_rows() else "check"


def published_table(predictions: list[Prediction] | None = None) -> str:
    """The Markdown table docs/planning.md shows (a test keeps the two equal); `predictions`
    of `published_runs()` in order, when the caller has them."""
    head = (
        "| run | GPUs | layout | batch x seq | published tokens/s/GPU (MFU) | plait step "
        "| plait tokens/s/GPU (MFU) | as plait runs it | plait / published | band | role |"
    )
    lines = [head, "|" + "---|" * 11]
    for p in predictions or [predict(r) for r in published_runs()]:
        r, hw = p.run, load_hardware(p.run.hardware)
        pub = r.published_tokens()
        pub_mfu = pub * p.flops_per_token / hw.peak_flops
        lines.append(
            f"| {r.label} | {r.gpus:,} {hw.name} | {_layout(p.run)} | {r.global_batch:,} x "
            f"{r.seq_len:,} | {pub:,.0f} ({pub_mfu:.1%}) | {p.step:.3f} s | "
            f"{p.tokens_per_gpu():,.0f} ({p.mfu(hw):.1%}) | "
            f"{p.tokens_per_gpu(p.time.total):,.0f} ({p.mfu(hw, p.time.total):.1%}) | "
            f"{p.ratio:.2f} | ±{r.band:.0%} | {_role(r)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m plait.plan.published_runs: the table for docs/planning.md
    print(published_table())
