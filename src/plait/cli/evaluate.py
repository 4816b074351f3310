"""`plait eval`: a model's token-weighted loss on a dataset, in any layout (evaluate.py).

The model is `--init-from` (a Hugging Face folder) or `--checkpoint` (a checkpoint or a run
folder, written in any layout); the data is prepared shards (text or examples) or a raw file:
`--format alpaca|chat` files are prepared here, before any worker starts, into a temporary
examples folder with the same code as `plait data prepare` (the tokenizer defaults to the
model's), and `--format text` reads text as `plait train` does. Every layout flag of `plait
train` applies; the global batch is one micro-batch per replica.
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

from plait.checkpoint import inspect
from plait.cli.models import checkpoint_path, run_tokenizer
from plait.cli.run_flags import add_run_flags, config_from_args
from plait.config import Config
from plait.data.instruct import FORMATS, InstructJob, prepare_examples
from plait.data.shards import is_shard_dir
from plait.errors import ConfigError, print_bad_input
from plait.evaluate import check_rows, eval_rows, eval_worker
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
class Request:
    """A checked `plait eval`: the run's config and where its data and weights are."""

    cfg: Config
    checkpoint: str | None
    scratch: Path | None  # a temporary examples folder to remove afterwards


def _given(args: argparse.Namespace, dest: str):
    return getattr(args, dest, None)


def _tokenizer(args: argparse.Namespace, checkpoint: Path | None) -> str:
    """The tokenizer a raw instruction file is prepared with: --tokenizer, else the model's."""
    given = _given(args, "data.tokenizer")
    if given:
        return given
    folder = _given(args, "train.init_from")
    if folder and (Path(folder) / "tokenizer.json").is_file():
        return folder
    if checkpoint is not None and run_tokenizer(checkpoint).path:
        return run_tokenizer(checkpoint).path
    raise ConfigError(
        f"--format {args.format} needs a tokenizer: give --tokenizer, or a model whose folder "
        "or run has one"
    )


def _prepare_raw(args: argparse.Namespace, checkpoint: Path | None) -> Path | None:
    """A raw alpaca/chat file prepared into a temporary folder (the caller removes it)."""
    data = _given(args, "data.path")
    fmt = args.format or "text"
    if data and is_shard_dir(data):
        if args.format:
            raise ConfigError(f"--data {data} is prepared shards; leave out --format")
        return None
    if fmt == "text":
        for flag, value in (("--columns", args.columns), ("--chat-template", args.chat_template),
                            ("--train-on-input", args.train_on_input)):  # fmt: skip
            if value:
                raise ConfigError(f"{flag} is for --format alpaca or chat, not text")
        return None
    if not data:
        raise ConfigError(f"--format {fmt} needs --data FILE")
    scratch = Path(tempfile.mkdtemp(prefix="plait-eval-")) / "examples"
    job = InstructJob(data, scratch, fmt, _tokenizer(args, checkpoint), args.columns,
                      args.chat_template, args.train_on_input)  # fmt: skip
    try:
        prepare_examples(job)
    except BaseException:
        shutil.rmtree(scratch.parent, ignore_errors=True)
        raise
    setattr(args, "data.path", str(scratch))
    setattr(args, "data.tokenizer", None)  # the examples folder names its own
    return scratch


def _adjust(checkpoint: Path | None) -> Callable[[Config], None]:
    """What eval derives rather than takes: the checkpoint's model (before validation, which
    checks --seq-len against it) and one micro-batch per replica as the global batch."""

    def adjust(cfg: Config) -> None:
        if checkpoint is not None:
            cfg.model = inspect.model_config(checkpoint)
        cfg.train.global_batch = cfg.train.micro_batch * cfg.parallel.layout.dp

    return adjust


def check_request(args: argparse.Namespace) -> Request:
    """Everything checked before a worker starts; raw files prepared."""
    if args.checkpoint and (_given(args, "train.init_from") or args.preset):
        raise ConfigError("--checkpoint names the model; leave out --init-from and --model")
    checkpoint = checkpoint_path(args.checkpoint) if args.checkpoint else None
    scratch = _prepare_raw(args, checkpoint)
    try:
        cfg = config_from_args(args, check_data=False, adjust=_adjust(checkpoint))
        check_rows(cfg, eval_rows(cfg))
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch.parent, ignore_errors=True)
        raise
    return Request(cfg, str(checkpoint) if checkpoint else None, scratch)


def _say(figures: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(figures))
        return
    print(
        f"loss {figures['loss']:.6f} (perplexity {figures['perplexity']:.4g}) over "
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
