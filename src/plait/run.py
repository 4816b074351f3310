"""A whole run on one rank: train for the configured steps, validate, log, summarize.

Every rank executes the same code; only rank 0 shows progress and writes files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console

from plait.config import Config
from plait.data.batches import Corpus
from plait.device import peak_flops
from plait.mesh import Mesh
from plait.models.transformer import count_parameters, matmul_flops_per_token
from plait.parallel.pipeline.output.report import report
from plait.step import StepResult
from plait.telemetry import MetricsLog, RunSummary, make_progress, summary_table
from plait.train import Trainer, is_two_bw


def _row(r: StepResult, trainer: Trainer, flops_per_token: int, peak: float | None) -> dict:
    tokens_per_s = r.tokens / r.time_s
    flops = tokens_per_s * flops_per_token
    row = {
        "step": r.step,
        "loss": r.loss,
        "lr": r.lr,
        "grad_norm": r.grad_norm,
        "step_time_s": r.time_s,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": flops,
        "comm_bytes": trainer.comm.stats.bytes_by_op(),
    }
    if peak:
        row["mfu"] = flops / (peak * trainer.mesh.world_size)
    if trainer.zero:  # ZeRO engine: what this rank holds, and fp16's scale
        row["model_state_bytes"] = trainer.zero.memory.model_state_bytes()
        row["loss_scale"] = trainer.zero.loss_scale
        row["step_skipped"] = trainer.zero.last_step_skipped
    return row


def _trace(trainer: Trainer, out: Path, lead: bool) -> dict | None:
    """The last step's pipeline timeline: every pp rank's actions, drawn and measured."""
    timings = trainer.pipeline.gather_timings()  # collective over the pp axis
    return report(trainer.pipeline.schedule, timings, out) if lead else None


def run(cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> RunSummary:
    """Train `cfg` on this rank; returns the summary (identical numbers on every rank)."""
    t = cfg.train
    trainer = Trainer(cfg, mesh, corpus)
    lead = mesh.is_logging_rank
    console = Console(stderr=True)
    log = MetricsLog(Path(t.out), t.tensorboard) if lead else None
    if lead:
        Path(t.out, "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    flops_per_token = matmul_flops_per_token(cfg.model, t.seq_len)
    peak = t.peak_flops or peak_flops(mesh.device)
    summary = RunSummary(
        layout=mesh.layout.describe(),
        params=count_parameters(cfg.model),
        steps=t.steps,
        tokens_per_step=trainer.tokens_per_step,
        final_loss=float("nan"),
        val_loss=None,
        unigram_baseline=trainer.corpus.unigram_baseline,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        world_size=mesh.world_size,
    )
    progress = make_progress(console, t.steps) if lead and t.progress else None
    task = progress.add_task("train", total=t.steps, info="") if progress else None

    def record(result: StepResult) -> None:
        """Everything after a step: metrics, validation, progress (every rank calls it)."""
        row = _row(result, trainer, flops_per_token, peak)
        summary.step_times.append(result.time_s)
        summary.final_loss = result.loss
        summary.comm_bytes_per_step = row["comm_bytes"]
        summary.model_state_bytes = row.get("model_state_bytes")
        done = result.step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            summary.val_loss = row["val_loss"] = trainer.evaluate()
        if log:
            log.write(row)
        if progress:
            val = f" val {summary.val_loss:.3f}" if summary.val_loss is not None else ""
            info = f"loss {result.loss:.3f}{val} {summary.recent_tokens_per_s():,.0f} tok/s"
            progress.update(task, advance=1, info=info)

    try:
        if progress:
            progress.start()
        for _ in range(t.steps):
            injected_fault(mesh.rank, trainer.step)
            record(trainer.train_step())
        if t.trace and trainer.pipeline and not is_two_bw(cfg):  # 2BW: one stream, no step
            summary.pipeline = _trace(trainer, Path(t.out), lead)
    finally:
        if progress:
            progress.stop()
        if log:
            log.close()
        trainer.close()
    if lead:
        Path(t.out, "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
        console.print(summary_table(summary))
    return summary


def injected_fault(rank: int, step: int) -> None:
    """Test hook: PLAIT_FAULT='RANK:STEP' makes that rank raise at that step.

    It exists so the failure path (one rank dies, all stop, its traceback shown) is tested
    end to end through the real launcher.
    """
    spec = os.environ.get("PLAIT_FAULT")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected fault (PLAIT_FAULT={spec}) on rank {rank} at step {step}")
