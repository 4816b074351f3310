"""A whole run on one rank: train for the configured steps, validate, log, summarize.

Every rank executes the same code; only rank 0 shows progress and writes files.
"""

from __future__ import annotations

import json
import math
import signal
from functools import partial
from pathlib import Path
from typing import Protocol

from rich.console import Console

from plait.checkpoint import store
from plait.config import Config, OptimConfig, TrainConfig
from plait.data.batches import Corpus
from plait.data.stream import data_tokenizer
from plait.device import peak_flops
from plait.mesh import Mesh
from plait.models.transformer import count_parameters, matmul_flops_per_token
from plait.outdir import atomic_file
from plait.schedule.measured import report
from plait.signals import StopRequest, pause_at
from plait.step import StepResult
from plait.telemetry import MetricsLog, RunSummary, make_progress, summary_table
from plait.text_sample import SAMPLE_MAX_PARAMS, sample
from plait.train import Trainer


class RunHook(Protocol):
    """Points of a run where a test acts (the injected faults of `faults.py`); production
    runs pass None, so the loop has nothing to check."""

    def before_step(self, step: int) -> None: ...

    def before_commit(self, step: int) -> None: ...


def run(
    cfg: Config,
    mesh: Mesh,
    corpus: Corpus | None = None,
    hook: RunHook | None = None,
    attempt: int = 0,
) -> RunSummary:
    """Train `cfg` on this rank; returns the summary (identical numbers on every rank).
    `attempt`: which start of the world this is (0: the first; the launcher counts them)."""
    current = Run(cfg, mesh, corpus, hook, attempt)
    try:
        try:
            current.train()
            current.finish()
        finally:
            current.close()
        return current.report()  # a signal now is still a request: the table is not cut
    finally:
        current.stop.restore()


class Run:
    """One rank's run, in the order it happens: built (the trainer, a resumed checkpoint, the
    metrics log), `train` (one step, then its record, until the steps are done or the ranks
    agree to stop), `finish` (the last checkpoint, the trace), `close`, `report`."""

    def __init__(
        self, cfg: Config, mesh: Mesh, corpus: Corpus | None, hook: RunHook | None, attempt: int
    ) -> None:
        t = cfg.train
        self.cfg, self.mesh, self.hook, self.out = cfg, mesh, hook, Path(cfg.log.out)
        self.lead = mesh.is_logging_rank  # rank 0 alone prints and writes files
        self.console = Console(stderr=True, soft_wrap=True)
        self.trainer = Trainer(cfg, mesh, corpus)
        if self.lead and self.trainer.corpus.report:  # instruction data: rows and packing
            self.console.print(self.trainer.corpus.report, highlight=False)
        if self.lead and t.epochs:  # before the first step: what --epochs came to
            self.console.print(
                epochs_line(t, cfg.optim, len(self.trainer.corpus.train)), highlight=False
            )
        self._resume()
        keep = (
            self.trainer.step if cfg.checkpoint.resume else None
        )  # a resumed run continues its metrics
        self.log = (
            MetricsLog(self.out, cfg.log.tensorboard, keep_before=keep) if self.lead else None
        )
        if self.lead:
            _write_json(self.out / "config.json", cfg.to_dict())
        self.flops_per_token = matmul_flops_per_token(cfg.model, t.seq_len)
        self.peak = cfg.log.peak_flops or peak_flops(mesh.device)
        self.summary = _summary(cfg, mesh, self.trainer, self.flops_per_token, self.peak)
        self.summary.restarts = attempt
        self.summary.steps_done, self.summary.out = self.trainer.step, str(self.out)
        self.stop_key = f"plait/stop/{attempt}"  # a restarted world agrees afresh
        self.progress = (
            make_progress(self.console, t.steps) if self.lead and cfg.log.progress else None
        )
        if self.progress:
            self.task = self.progress.add_task("train", total=t.steps, completed=self.trainer.step,
                                               info="")  # fmt: skip
        self.saved_at = self.trainer.step if cfg.checkpoint.resume else -1
        self.stop = StopRequest()  # last: from here on `close` must run to restore handlers

    def _resume(self) -> None:
        start = (
            store.resolve(self.cfg.checkpoint.resume, self.out)
            if self.cfg.checkpoint.resume
            else None
        )
        if start is not None:
            self.trainer.load(start)
            if self.lead:  # which checkpoint, as `latest` or a run folder chose it
                self.console.print(f"resuming from {start} at step {self.trainer.step}")
        elif self.cfg.checkpoint.resume and self.lead:
            where = self.out / "checkpoints"
            self.console.print(f"no checkpoint under {where} yet: starting from step 0")

    def train(self) -> None:
        """Step until the configured count, or until the ranks agree to stop on a signal."""
        trainer = self.trainer
        if self.progress:
            self.progress.start()
        while trainer.step < self.cfg.train.steps:
            if self.hook:
                self.hook.before_step(trainer.step)
            self.record(trainer.train_step())
            if trainer.comm.agreed_stop(trainer.step, self.stop.requested, self.stop_key):
                self.summary.stopped_by = self.stop.signum
                return

    def record(self, result: StepResult) -> None:
        """Everything after a step: metrics, validation, a checkpoint, progress (every rank
        calls it: validation and saving are collective)."""
        t, summary = self.cfg.train, self.summary
        row = _row(result, self.trainer, self.flops_per_token, self.peak)
        if result.drain:  # 2BW's last updates: their time is the drain, shared, not a step's
            row["drain"] = True
        else:
            summary.step_times.append(result.time_s)
        summary.final_loss = result.loss
        summary.skipped_steps += result.skipped
        summary.comm_bytes_per_step = row["comm_bytes"]
        summary.model_state_bytes = row.get("model_state_bytes")
        done = summary.steps_done = result.step + 1
        best = False
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            pause_at("evaluate", f"rank{self.mesh.rank}")  # a test's signal comes here
            summary.val_loss = row["val_loss"] = self.trainer.evaluate()
            summary.val_step = done
            best = self.cfg.checkpoint.keep_best and self.improved(summary.val_loss, done)
        if (self.cfg.checkpoint.save_every and done % self.cfg.checkpoint.save_every == 0) or best:
            row.update(self.save())
        if best:
            summary.best_checkpoint = str(store.step_dir(self.out, done))
            if self.lead:  # after the save committed: the marker names a whole one
                store.mark_best(
                    self.out, done, summary.val_loss, self.cfg.checkpoint.keep_checkpoints
                )
        if self.trainer.batches.target_tokens(result.step) is not None and not result.drain:
            summary.step_targets.append(self.trainer.batches.target_tokens(result.step))
        if self.log:
            self.log.write(row)
        if self.progress:
            val = f" val {summary.val_loss:.3f}" if summary.val_loss is not None else ""
            info = f"loss {result.loss:.3f}{val} {summary.recent_tokens_per_s():,.0f} tok/s"
            self.progress.update(self.task, advance=1, info=info)

    def improved(self, val_loss: float, done: int) -> bool:
        """Whether `val_loss` after `done` steps is the best so far (kept in the trainer
        state, so a resumed run compares with the validations before it)."""
        best = self.trainer.best
        if not math.isfinite(val_loss) or (best is not None and not val_loss < best["val_loss"]):
            return False
        self.trainer.best = {"step": done, "val_loss": val_loss}
        self.summary.best_step, self.summary.best_val_loss = done, val_loss
        return True

    def save(self) -> dict:
        """Checkpoint the steps done so far (every rank), say where and what it cost (rank
        0); returns the metrics row's checkpoint fields."""
        step = self.saved_at = self.trainer.step
        before_commit = partial(self.hook.before_commit, step) if self.hook else None
        stats = self.trainer.save(self.out, before_commit)
        self.summary.checkpoint = stats["path"]
        if self.lead:
            size = stats["bytes"] / 2**20
            self.console.print(
                f"checkpoint {stats['path']}: {size:.1f} MiB in {stats['seconds']:.2f} s"
            )
        return {"checkpoint_s": stats["seconds"], "checkpoint_bytes": int(stats["bytes"])}

    def finish(self) -> None:
        """The last checkpoint (unless the last step wrote one), what stopped the run early,
        the last step's pipeline trace."""
        _t, trainer, summary = self.cfg.train, self.trainer, self.summary
        if self.cfg.checkpoint.save and self.saved_at != trainer.step:
            self.save()
        if summary.stopped_by is not None and self.lead:
            name = signal.Signals(summary.stopped_by).name
            where = (f"; checkpoint {summary.checkpoint}; continue with --resume latest --out "
                     f"{self.out}" if summary.checkpoint else "")  # fmt: skip
            self.console.print(f"plait: stopped by {name} after step {trainer.step}{where}")
        if self.cfg.log.trace and trainer.pipeline and not self.cfg.parallel.two_bw:  # 2BW: no step
            summary.pipeline = _trace(trainer, self.out, self.lead)

    def close(self) -> None:
        """Progress and log closed, the engine's resources freed (the signal handlers stay
        until the report is out: `run`)."""
        if self.progress:
            self.progress.stop()
        if self.log:
            self.log.close()
        self.trainer.close()

    def report(self) -> RunSummary:
        """Rank 0: a sample from the last checkpoint, `summary.json` and the table."""
        summary = self.summary
        if self.lead and summary.checkpoint and summary.params <= SAMPLE_MAX_PARAMS:
            pause_at("sample", "rank0")  # a test's signal comes here
            summary.sample = sample(Path(summary.checkpoint), self.trainer.corpus, self.cfg)
        if self.lead:
            _write_json(self.out / "summary.json", summary.as_dict())
            self.console.print(summary_table(summary))
            if self.stop.requested and summary.stopped_by is None:  # after the last step
                name = signal.Signals(self.stop.signum).name
                self.console.print(f"plait: {name} came after the last step; the run is whole")
        return summary


def _write_json(path: Path, value: dict) -> None:
    """A run file whole or not at all: a signal or a full disk never leaves half of it."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2))


def _row(r: StepResult, trainer: Trainer, flops_per_token: int, peak: float | None) -> dict:
    """A step's metrics row (rank 0 writes it to metrics.jsonl)."""
    tokens_per_s = r.tokens / r.time_s
    flops = tokens_per_s * flops_per_token
    engine = trainer.engine
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
    if engine.memory:  # what this rank holds
        row["model_state_bytes"] = engine.memory.model_state_bytes()
    row["loss_scale"] = engine.loss_scale  # fp16's scaler (1.0 without one)
    row["step_skipped"] = r.skipped  # fp16 overflow or --nan-policy skip
    return row


def _trace(trainer: Trainer, out: Path, lead: bool) -> dict | None:
    """The last step's pipeline timeline: every pp rank's actions, drawn and measured."""
    timings = trainer.pipeline.gather_timings()  # collective over the pp axis
    return report(trainer.pipeline.schedule, timings, out) if lead else None


def _summary(
    cfg: Config, mesh: Mesh, trainer: Trainer, flops_per_token: int, peak: float | None
) -> RunSummary:
    bpe = data_tokenizer(cfg.data.path, cfg.data.tokenizer).path is not None
    best = trainer.best or {}  # a resumed run's best so far
    return RunSummary(
        layout=mesh.layout.describe(),
        params=count_parameters(cfg.model),
        trainable_params=count_parameters(cfg.model, trainable=True),
        epochs=cfg.train.epochs,
        best_step=best.get("step"),
        best_val_loss=best.get("val_loss"),
        best_checkpoint=str(store.step_dir(Path(cfg.log.out), best["step"])) if best else None,
        steps=cfg.train.steps,
        tokens_per_step=trainer.tokens_per_step,
        final_loss=float("nan"),
        val_loss=None,
        unigram_baseline=trainer.corpus.unigram_baseline,
        flops_per_token=flops_per_token,
        peak_flops=peak,
        world_size=mesh.world_size,
        token_kind="BPE token" if bpe else "byte",
    )


def epochs_line(t: TrainConfig, o: OptimConfig, rows: int) -> str:
    """What --epochs came to (config.derive_steps), said before the first step."""
    per = rows // t.global_batch
    warmup = f"; warmup {o.warmup_steps} steps" if o.warmup_ratio else ""
    return (
        f"{t.epochs} epochs of {rows:,} training rows at global batch {t.global_batch}: "
        f"{per:,} steps an epoch, {t.steps:,} steps{warmup}"
    )
