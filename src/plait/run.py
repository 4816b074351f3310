"""A whole run on one rank: train for the configured steps, validate, log, summarize.

Every rank executes the same code; only rank 0 shows progress and writes files.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from rich.console import Console

from plait.checkpoint import inspect, store
from plait.config import Config
from plait.data.batches import Corpus
from plait.data.stream import data_tokenizer
from plait.data.tokenizer import text_tokenizer
from plait.device import peak_flops
from plait.mesh import Mesh
from plait.models.generate import complete
from plait.models.transformer import count_parameters, matmul_flops_per_token
from plait.schedule.measured import report
from plait.signals import FORWARDED, StopRequest
from plait.step import StepResult
from plait.telemetry import MetricsLog, RunSummary, make_progress, summary_table
from plait.train import Trainer


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
    if trainer.engine.memory:  # what this rank holds
        row["model_state_bytes"] = trainer.engine.memory.model_state_bytes()
    if trainer.zero:  # fp16's scale
        row["loss_scale"] = trainer.zero.loss_scale
        row["step_skipped"] = trainer.zero.last_step_skipped
    return row


def _trace(trainer: Trainer, out: Path, lead: bool) -> dict | None:
    """The last step's pipeline timeline: every pp rank's actions, drawn and measured."""
    timings = trainer.pipeline.gather_timings()  # collective over the pp axis
    return report(trainer.pipeline.schedule, timings, out) if lead else None


def run(cfg: Config, mesh: Mesh, corpus: Corpus | None = None) -> RunSummary:
    """Train `cfg` on this rank; returns the summary (identical numbers on every rank)."""
    t, out = cfg.train, Path(cfg.train.out)
    trainer = Trainer(cfg, mesh, corpus)
    lead = mesh.is_logging_rank
    console = Console(stderr=True, soft_wrap=True)
    start = store.resolve(t.resume, out) if t.resume else None
    if start is not None:
        trainer.load(start)
    elif t.resume and lead:
        console.print(f"no checkpoint under {out / 'checkpoints'} yet: starting from step 0")
    keep = trainer.step if t.resume else None  # a resumed run continues its metrics
    log = MetricsLog(out, t.tensorboard, keep_before=keep) if lead else None
    if lead:
        Path(t.out, "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    flops_per_token = matmul_flops_per_token(cfg.model, t.seq_len)
    peak = t.peak_flops or peak_flops(mesh.device)
    summary = _summary(cfg, mesh, trainer, flops_per_token, peak)
    summary.restarts = attempt()
    progress = make_progress(console, t.steps) if lead and t.progress else None
    if progress:
        task = progress.add_task("train", total=t.steps, completed=trainer.step, info="")
    saved_at = trainer.step if t.resume else -1
    stop = StopRequest()

    def save() -> dict:
        nonlocal saved_at
        saved_at = trainer.step
        fault = lambda: injected_fault(mesh.rank, f"save-{trainer.step}")  # noqa: E731
        return _checkpoint(trainer, out, summary, console if lead else None, fault)

    def record(result: StepResult) -> None:
        """Everything after a step: metrics, validation, progress (every rank calls it)."""
        row = _row(result, trainer, flops_per_token, peak)
        if result.drain:  # 2BW's last updates: their time is the drain, shared, not a step's
            row["drain"] = True
        else:
            summary.step_times.append(result.time_s)
        summary.final_loss = result.loss
        summary.comm_bytes_per_step = row["comm_bytes"]
        summary.model_state_bytes = row.get("model_state_bytes")
        done = result.step + 1
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            summary.val_loss = row["val_loss"] = trainer.evaluate()
        if t.save_every and done % t.save_every == 0:
            row.update(save())
        if log:
            log.write(row)
        if progress:
            val = f" val {summary.val_loss:.3f}" if summary.val_loss is not None else ""
            info = f"loss {result.loss:.3f}{val} {summary.recent_tokens_per_s():,.0f} tok/s"
            progress.update(task, advance=1, info=info)

    try:
        if progress:
            progress.start()
        for _ in range(trainer.step, t.steps):
            injected_fault(mesh.rank, trainer.step)
            record(trainer.train_step())
            if trainer.comm.agreed_stop(trainer.step, stop.requested, f"plait/stop/{attempt()}"):
                summary.stopped_by = stop.signum
                break
        if t.save and saved_at != trainer.step:
            save()
        if summary.stopped_by is not None and lead:
            where = f"; checkpoint {summary.checkpoint}" if summary.checkpoint else ""
            name = signal.Signals(summary.stopped_by).name
            name = "the launcher's signal" if summary.stopped_by == FORWARDED else name
            console.print(f"plait: stopped by {name} after step {trainer.step}{where}")
        if t.trace and trainer.pipeline and not cfg.parallel.two_bw:  # 2BW: one stream, no step
            summary.pipeline = _trace(trainer, Path(t.out), lead)
    finally:
        stop.restore()
        if progress:
            progress.stop()
        if log:
            log.close()
        trainer.close()
    if lead and summary.checkpoint and summary.params <= SAMPLE_MAX_PARAMS:
        summary.sample = sample(Path(summary.checkpoint), trainer.corpus, cfg)
    if lead:
        Path(t.out, "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
        console.print(summary_table(summary))
    return summary


SAMPLE_PROMPT, SAMPLE_TOKENS = 16, 48
SAMPLE_MAX_PARAMS = 150_000_000  # above: reading it whole on one CPU is no longer cheap


def sample(checkpoint: Path, corpus: Corpus, cfg: Config) -> dict[str, str]:
    """A short greedy continuation of the validation text's start by the trained model,
    read back whole from its last checkpoint by rank 0 alone: any layout, no collective, so
    no other rank waits."""
    model = inspect.load_model(checkpoint)
    tokenizer = text_tokenizer(data_tokenizer(cfg.data.path, cfg.data.tokenizer))
    prompt = tokenizer.decode(corpus.val.batch([0])[0][0, :SAMPLE_PROMPT])
    room = model.cfg.max_seq_len - len(tokenizer.encode(prompt))
    n = min(SAMPLE_TOKENS, room) if model.cfg.pos == "learned" else SAMPLE_TOKENS
    return {"prompt": prompt, "text": complete(model, tokenizer, prompt, n)}


def _summary(
    cfg: Config, mesh: Mesh, trainer: Trainer, flops_per_token: int, peak: float | None
) -> RunSummary:
    return RunSummary(
        layout=mesh.layout.describe(),
        params=count_parameters(cfg.model),
        steps=cfg.train.steps,
        tokens_per_step=trainer.tokens_per_step,
        final_loss=float("nan"),
        val_loss=None,
        unigram_baseline=trainer.corpus.unigram_baseline,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        world_size=mesh.world_size,
    )


def _checkpoint(
    trainer: Trainer, out: Path, summary: RunSummary, console: Console | None, fault
) -> dict:
    """Save (every rank), say where and what it cost (rank 0); the row's checkpoint fields."""
    stats = trainer.save(out, before_commit=fault)
    summary.checkpoint = stats["path"]
    if console is not None:
        size = stats["bytes"] / 2**20
        console.print(f"checkpoint {stats['path']}: {size:.1f} MiB in {stats['seconds']:.2f} s")
    return {"checkpoint_s": stats["seconds"], "checkpoint_bytes": int(stats["bytes"])}


ATTEMPT_ENV = "PLAIT_ATTEMPT"
"""Which start of the world this is (0: the first), set by the launcher for its workers."""


def attempt() -> int:
    """This world's start: torchrun's restart count under torchrun, else the launcher's."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(ATTEMPT_ENV) or 0)


def injected_fault(rank: int, step: int | str) -> None:
    """Test hook: PLAIT_FAULT='RANK:STEP' makes that rank raise at that step ('RANK:save-N':
    while saving the step-N checkpoint, before it is committed), on the first start only.

    It exists so the failure paths (one rank dies, all stop, its traceback shown; a restart
    from the newest checkpoint; a save cut short) are tested end to end through the real
    launcher.
    """
    spec = os.environ.get("PLAIT_FAULT")
    if spec and spec == f"{rank}:{step}" and attempt() == 0:
        raise RuntimeError(f"injected fault (PLAIT_FAULT={spec}) on rank {rank} at step {step}")
