"""`plait tokenizer train` and `plait data prepare`: their flags, progress and summary; the
work itself is `plait.data` (tokenizer.py, prepare.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from plait.data.instruct import FORMATS, InstructJob, prepare_examples, refuse_text_flags
from plait.data.packing import LONG, length_report
from plait.data.prepare import SHARD_TOKENS, PrepareJob, prepare
from plait.data.sources import check_sources, iter_texts, source_files, total_bytes
from plait.data.stdlib_instructions import Limits, write_jsonl
from plait.data.stdlib_instructions import build as build_instructions
from plait.data.tokenizer import train_bpe
from plait.domain import Once, at_least
from plait.errors import ConfigError, print_bad_input
from plait.outdir import atomic_file, check_out_file

COMMANDS = ("tokenizer", "data")


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (HF tokenizers)")
    tok_actions = tok.add_subparsers(dest="action", required=True)
    train = tok_actions.add_parser("train", help="train on text files, folders, .jsonl, .parquet")
    _add_data_flag(train)
    train.add_argument(
        "--vocab-size", type=at_least(1), required=True, help="tokens, with <|endoftext|>"
    )
    train.add_argument("--out", required=True, help="the tokenizer.json file to write")
    _add_common(train)
    data = sub.add_parser("data", help="prepare token shards for `plait train --data DIR`")
    data_actions = data.add_subparsers(dest="action", required=True)
    prep = data_actions.add_parser("prepare", help="tokenize text into memory-mapped shards")
    _add_data_flag(prep)
    prep.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or HF folder; default: bytes"
    )
    prep.add_argument("--out", required=True, help="the shard folder to write")
    prep.add_argument("--workers", type=at_least(1), default=os.cpu_count() or 1, help="processes")
    prep.add_argument(
        "--shard-tokens", type=at_least(1), default=SHARD_TOKENS, help="tokens per shard"
    )
    prep.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    _add_common(prep)
    _add_instruct_flags(prep)
    _add_instructions_command(data_actions)


def _add_instruct_flags(prep: argparse.ArgumentParser) -> None:
    group = prep.add_argument_group("instruction data (--format alpaca|chat)")
    group.add_argument(
        "--format", choices=FORMATS, default="text",
        help="text: documents (default); alpaca: instruction/input/output rows (a JSON array "
        "or JSONL); chat: JSONL rows of messages (role, content)",
    )  # fmt: skip
    group.add_argument(
        "--columns", default=None,
        help="read fields under other names, e.g. instruction=prompt,output=completion",
    )  # fmt: skip
    group.add_argument(
        "--chat-template", default=None,
        help="a Jinja chat template file; default: the tokenizer folder's",
    )  # fmt: skip
    group.add_argument(
        "--train-on-input", action="store_true",
        help="prompt tokens are targets too (default: responses only)",
    )  # fmt: skip
    group.add_argument(
        "--seq-len", type=at_least(1), default=None,
        help="report how many examples are longer than this (rows are packed at train time)",
    )  # fmt: skip
    group.add_argument(
        "--long", choices=LONG, default="truncate",
        help="with --seq-len: report an example longer than it as truncated or dropped",
    )  # fmt: skip


def _add_data_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", default=None, action=Once,
        help="file or folder (default: the standard library sources); once",
    )  # fmt: skip


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-key", default="text", help=".jsonl field / .parquet column")
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )


def run_data_command(args: argparse.Namespace, err: Console) -> int:
    """Run `tokenizer train` or `data prepare`; bad input is one line on stderr, exit 2."""
    try:
        if args.command == "tokenizer":
            return _train_tokenizer(args)
        if args.action == "instructions":
            return _instructions(args)
        return _prepare(args)
    except ConfigError as e:
        return print_bad_input(err, e)


def _train_tokenizer(args: argparse.Namespace) -> int:
    check_out_file(Path(args.out))
    files = source_files(args.data)
    check_sources(files, args.text_key)
    # HF's bars write to stdout, and only bare newlines when it is not a terminal.
    bars = args.progress and sys.stdout.isatty()
    spec = train_bpe(iter_texts(files, args.text_key), args.vocab_size, Path(args.out), None, bars)
    # print, not rich: rich breaks the line inside the hash where the terminal is narrow.
    print(f"wrote {args.out}: vocabulary {spec.vocab_size}, sha256 {spec.identity}")
    return 0


def mb_per_s(nbytes: float, seconds: float) -> str:
    """The reading speed both the bar and the last line show: bytes read over the wall
    time since the start (rich's own speed column averages recent bursts, 821.5 MB/s on a
    bar whose run reads 0.9 MB/s)."""
    return f"{nbytes / seconds / 1e6:,.1f} MB/s" if seconds > 0 else "? MB/s"


class _SpeedSinceStart(ProgressColumn):
    """`mb_per_s` of the bytes done since `began`, the same clock as the last line."""

    def __init__(self, began: float) -> None:
        super().__init__()
        self.began = began

    def render(self, task: Task) -> Text:
        return Text(mb_per_s(task.completed, time.perf_counter() - self.began))


def _prepare(args: argparse.Namespace) -> int:
    if args.format != "text":
        return _prepare_examples(args)
    refuse_text_flags(args.columns, args.chat_template, args.train_on_input)
    job = PrepareJob(
        data=args.data,
        out=Path(args.out),
        tokenizer=args.tokenizer,
        text_key=args.text_key,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    total = total_bytes(source_files(args.data))
    began = time.perf_counter()
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), _SpeedSinceStart(began),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, disable=not args.progress) as bar:
        task = bar.add_task("prepare", total=total)
        index = prepare(job, lambda n: bar.advance(task, n))
    seconds = time.perf_counter() - began
    Console().print(
        f"wrote {args.out}: {index['tokens']:,} tokens ({index['dtype']}) in "
        f"{len(index['shards'])} shards from {len(index['sources'])} files, "
        f"{index['documents']:,} documents; {mb_per_s(total, seconds)}, "
        f"{index['tokens'] / seconds:,.0f} tokens/s"
    )
    return 0


def _add_instructions_command(actions: argparse._SubParsersAction) -> None:
    """`plait data instructions`: the offline instruction set (data/stdlib_instructions.py)."""
    ins = actions.add_parser(
        "instructions", help="Alpaca JSONL from documented Python functions (offline)"
    )
    ins.add_argument("--out", required=True, help="the .jsonl file to write")
    ins.add_argument(
        "--source", default=None, help="a folder of .py files (default: the standard library)"
    )
    ins.add_argument(
        "--max-examples", type=at_least(1), default=10_000, help="keep at most N, evenly spread"
    )
    ins.add_argument(
        "--max-chars", type=at_least(1), default=Limits.max_record_chars,
        help="longest record (instruction + input + output), characters",
    )  # fmt: skip
    ins.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def _instructions(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_out_file(out, overwrite=args.overwrite)
    source = None if args.source is None else Path(args.source)
    limits = dataclasses.replace(Limits(), max_record_chars=args.max_chars)
    records, counts = build_instructions(source, args.max_examples, limits)
    with atomic_file(out) as tmp:
        write_jsonl(records, tmp)
    dropped = ", ".join(f"{n:,} {why}" for why, n in sorted(counts.dropped.items()))
    print(
        f"wrote {out}: {counts.kept:,} examples from {counts.files:,} files "
        f"({counts.documented:,} documented public functions; dropped: {dropped or 'none'}; "
        f"{counts.duplicates:,} duplicates, {counts.capped:,} over --max-examples, "
        f"{counts.unreadable:,} unreadable files)"
    )
    return 0


def _prepare_examples(args: argparse.Namespace) -> int:
    """`--format alpaca|chat`: read, check and tokenize every example in this process."""
    if args.chat_template and args.format != "chat":
        raise ConfigError(f"--chat-template is for --format chat, not {args.format}")
    job = InstructJob(
        data=args.data,
        out=Path(args.out),
        fmt=args.format,
        tokenizer=args.tokenizer,
        columns=args.columns,
        chat_template=args.chat_template,
        train_on_input=args.train_on_input,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    began = time.perf_counter()
    index = prepare_examples(job)
    seconds = time.perf_counter() - began
    meta = index["examples"]
    print(
        f"wrote {args.out}: {meta['count']:,} {args.format} examples, {index['tokens']:,} "
        f"tokens, {meta['target_tokens']:,} target tokens ({index['dtype']}, "
        f"{len(index['shards'])} shards); {index['tokens'] / seconds:,.0f} tokens/s"
    )
    dropped = meta.get("unrendered") or {}
    if dropped:
        roles = ", ".join(f"{n:,} {role}" for role, n in dropped.items())
        print(f"the chat template leaves out {sum(dropped.values()):,} messages ({roles}): "
              "their text is in no example")  # fmt: skip
    if args.seq_len:
        print(length_report(meta["lengths"], meta["first_target"], args.seq_len, args.long))
    return 0
