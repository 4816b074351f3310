"""`plait eval`: a model's token-weighted loss on a dataset, in any layout (evaluate.py).

The model is `--init-from` (a Hugging Face folder) or `--checkpoint` (a checkpoint or a run
folder, written in any layout); the data is prepared shards (text or examples) or a raw file:
`--format alpaca|chat` files are prepared here, before any worker starts, into a temporary
examples folder with the same code as `plait data prepare` (the tokenizer defaults to the
model's), and `--format text` reads text as `plait train` does. Every layout flag of `plait
train` applies; the global batch is one micro-batch per replica; a flag only training reads
is refused (`TRAIN_ONLY`). A LoRA checkpoint's base that moved is `--init-from NEWDIR`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.console import Console

from plait.checkpoint import inspect, store
from plait.cli.models import checkpoint_path, run_tokenizer
from plait.cli.run_flags import add_run_flags, config_from_args
from plait.config import Config
from plait.data.instruct import FORMATS, InstructJob, prepare_examples, refuse_text_flags
from plait.data.shards import is_shard_dir, shard_tokenizer
from plait.data.tokenizer import TokenizerSpec, resolve_tokenizer
from plait.errors import ConfigError, print_bad_input
from plait.evaluate import eval_rows, eval_worker, fit_rows
from plait.launch import Interrupted, WorkerFailure, launch
from plait.signals import exit_code


def add_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval", help="token-weighted loss and perplexity of a model on a dataset, any layout"
    )
    add_run_flags(ev)
    ev.add_argument("--checkpoint", help="a checkpoint folder, or a run's OUT (its latest)")
    ev.add_argument(
        "--format", choices=FORMATS, default=None,
        help="how to read a raw --data file (default: text; prepared shards say their own)",
    )  # fmt: skip
    ev.add_argument("--columns", help="field names, e.g. instruction=prompt,output=completion")
    ev.add_argument("--chat-template", help="a Jinja chat template file (--format chat)")
    ev.add_argument("--train-on-input", action="store_true", help="count prompt tokens too")
    ev.add_argument("--json", action="store_true", help="print one JSON object only")


@dataclass
class EvalRequest:
    """A checked `plait eval`: the run's config and where its data and weights are."""

    cfg: Config
    checkpoint: str | None
    scratch: Path | None  # a temporary examples folder to remove afterwards


def _given(args: argparse.Namespace, dest: str):
    return getattr(args, dest, None)


def _model_tokenizer(args: argparse.Namespace, checkpoint: Path | None) -> TokenizerSpec | None:
    """The model's own tokenizer: its folder's tokenizer.json, or the one its run trained
    with (bytes included); None when the model does not say (a folder without one)."""
    folder = _given(args, "checkpoint.init_from")
    if folder and (Path(folder) / "tokenizer.json").is_file():
        return resolve_tokenizer(folder)
    if checkpoint is not None:
        return _run_tokenizer(args, checkpoint)
    return None


def _run_tokenizer(args: argparse.Namespace, checkpoint: Path) -> TokenizerSpec | None:
    """The tokenizer the checkpoint's run trained with, found through its data (shards name
    theirs) and checked against the SHA-256 the run recorded: data moved or remade since
    would otherwise pass for bytes or another tokenizer. An explicit --tokenizer must be the
    recorded one; with it, the run's data is not needed (None)."""
    recorded = store.read_trainer(checkpoint)["config"]["data"].get("tokenizer_hash")
    given = _given(args, "data.tokenizer")
    if given:
        if resolve_tokenizer(given).identity != recorded:
            raise ConfigError(
                f"--tokenizer {given} is not the tokenizer the run of --checkpoint "
                f"{checkpoint} trained with (sha256 {recorded or 'none: bytes'})"
            )
        return None
    return run_tokenizer(checkpoint, ", or give --tokenizer")


def _model_name(args: argparse.Namespace, checkpoint: Path | None) -> tuple[str, str]:
    """The model as the user named it, and the tokenizer to prepare its data with."""
    if checkpoint is None:
        folder = _given(args, "checkpoint.init_from")
        return f"--init-from {folder}", folder
    return f"the run of --checkpoint {checkpoint}", run_tokenizer(checkpoint).name


def _check_shards(data: str, args: argparse.Namespace, checkpoint: Path | None) -> None:
    """Prepared shards must hold the model's tokens: made with its tokenizer (a checkpoint's
    --tokenizer, which is the run's, stands for it)."""
    model, given = _model_tokenizer(args, checkpoint), _given(args, "data.tokenizer")
    named, tokenizer = _model_name(args, checkpoint) if model else (f"--tokenizer {given}", given)
    if model is None and given:  # a checkpoint's --tokenizer (checked to be the run's)
        model = resolve_tokenizer(given)
    made = shard_tokenizer(data, None)
    if model is not None and model.identity != made.identity:
        raise ConfigError(
            f"shards {data!r} were made with tokenizer {made.name} (sha256 {made.identity}), "
            f"not with {named}'s; prepare them again with --tokenizer {tokenizer}"
        )


def _prepare_raw(args: argparse.Namespace, checkpoint: Path | None) -> Path | None:
    """A raw alpaca/chat file prepared into a temporary folder (the caller removes it); the
    tokenizer of a raw file (any format) is --tokenizer, else the model's."""
    data = _given(args, "data.path")
    fmt = args.format or "text"
    if data and is_shard_dir(data):
        if args.format:
            raise ConfigError(f"--data {data} is prepared shards; leave out --format")
        _check_shards(data, args, checkpoint)
        return None
    model = _model_tokenizer(args, checkpoint)
    tokenizer = _given(args, "data.tokenizer") or (model.path if model else None)
    if fmt == "text":
        refuse_text_flags(args.columns, args.chat_template, args.train_on_input)
        setattr(args, "data.tokenizer", tokenizer)
        return None
    if not data:
        raise ConfigError(f"--format {fmt} needs --data FILE")
    if not tokenizer:
        raise ConfigError(
            f"--format {fmt} needs a tokenizer: give --tokenizer, or a model whose folder "
            "or run has one"
        )
    scratch = Path(tempfile.mkdtemp(prefix="plait-eval-")) / "examples"
    job = InstructJob(data, scratch, fmt, tokenizer, args.columns, args.chat_template,
                      args.train_on_input)  # fmt: skip
    try:
        prepare_examples(job)
    except BaseException:
        shutil.rmtree(scratch.parent, ignore_errors=True)
        raise
    setattr(args, "data.path", str(scratch))
    setattr(args, "data.tokenizer", None)  # the examples folder names its own
    return scratch


def _adjust(checkpoint: Path | None, base_folder: str | None) -> Callable[[Config], None]:
    """What eval derives rather than takes: the checkpoint's model (before validation, which
    checks --seq-len against it), a LoRA checkpoint's base (the folder it names or
    `base_folder` where it moved, checked against its hash, or its seed: the workers build
    it, then load the adapters), and one micro-batch per replica as the global batch."""

    def adjust(cfg: Config) -> None:
        if checkpoint is not None:
            cfg.model = inspect.model_config(checkpoint)
            base = inspect.checked_base(checkpoint, store.read_trainer(checkpoint), base_folder)
            if base is not None:
                cfg.checkpoint.init_from = base["init_from"] or ""
                cfg.checkpoint.init_from_sha256, cfg.train.seed = base["sha256"], base["seed"]
        cfg.train.global_batch = cfg.train.micro_batch * cfg.parallel.layout.dp

    return adjust


TRAIN_ONLY = {
    "train": ("steps", "epochs", "global_batch", "loss_average", "eval_every", "eval_batches",
              "max_restarts", "nan_policy"),
    "optim": ("lr", "lr_schedule", "min_lr", "warmup_steps", "warmup_ratio", "weight_decay",
              "beta1", "beta2", "grad_clip"),
    "checkpoint": ("keep_best", "save_every", "save", "keep_checkpoints", "resume"),
    "log": ("out", "overwrite", "tensorboard", "peak_flops", "trace"),
    "data": ("val_fraction", "eval_data"),  # eval reads every row of --data
}  # fmt: skip
"""Flags that only training reads, by section: `plait eval` refuses them on its command line
(a config file may hold them: a recipe evaluates as it is)."""


def refuse_train_flags(args: argparse.Namespace) -> None:
    """One line for the first training-only flag given: it would change nothing."""
    given = [f"{section}.{k}" for section, keys in TRAIN_ONLY.items() for k in keys]
    for dest in given:
        if hasattr(args, dest):
            flag = "--" + dest.split(".", 1)[1].replace("_", "-")
            if dest == "checkpoint.save" and not getattr(args, dest):
                flag = "--no-save"
            raise ConfigError(
                f"{flag} is a training flag; plait eval trains nothing (it evaluates every row "
                "of --data with one micro-batch per replica): leave it out"
            )


def check_request(args: argparse.Namespace) -> EvalRequest:
    """Everything checked before a worker starts; raw files prepared."""
    refuse_train_flags(args)
    folder = _given(args, "checkpoint.init_from")
    if args.checkpoint and args.preset:
        raise ConfigError("--checkpoint names the model; leave out --model")
    base_folder = None
    if args.checkpoint and folder:  # a LoRA checkpoint's base where it moved (_adjust)
        base_folder, folder = folder, None
        delattr(args, "checkpoint.init_from")
    if not (args.checkpoint or folder):
        raise ConfigError("plait eval needs a model: --init-from HF_DIR or --checkpoint CK")
    if folder and not Path(folder).is_dir():
        raise ConfigError(f"--init-from {folder} is not a folder (a Hugging Face model folder)")
    checkpoint = checkpoint_path(args.checkpoint) if args.checkpoint else None
    data = _given(args, "data.path")  # the user's path, before a raw file's prepared copy
    scratch = _prepare_raw(args, checkpoint)
    try:
        cfg = config_from_args(args, check_data=False, adjust=_adjust(checkpoint, base_folder))
        fit_rows(cfg, eval_rows(cfg), data)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch.parent, ignore_errors=True)
        raise
    return EvalRequest(cfg, str(checkpoint) if checkpoint else None, scratch)


def _say(figures: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(figures))
        return
    ppl = "overflow" if figures["perplexity"] is None else f"{figures['perplexity']:.4g}"
    print(
        f"loss {figures['loss']:.6f} (perplexity {ppl}) over "
        f"{figures['target_tokens']:,} target tokens of {figures['examples']:,} examples in "
        f"{figures['rows']:,} rows ({figures['truncated']:,} truncated, "
        f"{figures['dropped']:,} dropped)"
    )


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        request = check_request(args)
    except ConfigError as e:
        return print_bad_input(err, e)
    with tempfile.TemporaryDirectory(prefix="plait-eval-result-") as tmp:
        result = Path(tmp) / "eval.json"
        try:
            launch(request.cfg, partial(eval_worker, checkpoint=request.checkpoint,
                                        result=str(result)))  # fmt: skip
            _say(json.loads(result.read_text()), args.json)
        except WorkerFailure as e:
            err.print("[bold red]plait: a worker failed; all ranks stopped.[/]")
            err.print(str(e), markup=False, highlight=False)
            return 1
        except (Interrupted, KeyboardInterrupt) as e:  # `Stopping` (SIGTERM) included
            err.print("[bold]plait: eval interrupted; every rank stopped.[/]")
            return exit_code(getattr(e, "signum", signal.SIGINT))
        finally:
            if request.scratch is not None:
                shutil.rmtree(request.scratch.parent, ignore_errors=True)
    return 0
