"""`plait` command line: `plait train`, `plait estimate`, `plait plan`, `plait calibrate`,
`plait presets`, `plait schedule`, `plait checkpoint`, `plait lessons`, the data commands
`plait tokenizer`, `plait data` (data_cli.py) and the model commands `plait export`,
`plait generate` (cli_models.py).

Flags are generated from the config dataclasses, so a field's help string is its flag's help
and a new field is a new flag. Everything is validated here, before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.calibrate import add_calibrate_parser
from plait.checkpoint import inspect
from plait.checkpoint.store import check_resumable, resolve
from plait.cli_lessons import add_lessons_command, lessons_main
from plait.cli_models import add_model_commands, export_main, generate_main, init_model
from plait.config import SECTIONS, Config, build_config, flag_name, load_toml
from plait.data_cli import COMMANDS as DATA_COMMANDS
from plait.data_cli import add_data_commands, run_data_command
from plait.device import device_kind
from plait.errors import ConfigError, print_bad_input
from plait.launch import Interrupted, WorkerFailure, launch, under_torchrun
from plait.outdir import prepare_out
from plait.plan.command import add_plan_parser


def _version() -> str:
    try:
        return importlib.metadata.version("plait")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def _value_type(f: dataclasses.Field) -> Any:
    text = str(f.type)
    if "bool" in text:
        return bool
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def _add_section(parser: argparse.ArgumentParser, section: str, cls: type) -> None:
    group = parser.add_argument_group(section)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):  # computed from other fields, never given
            continue
        kind = _value_type(f)
        kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        default = "the preset's" if section == "model" else f.default
        kwargs["help"] = f.metadata.get("help", "") + f" (default: {default})"
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = kind.__name__.upper()
        group.add_argument(flag_name(f), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"plait {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (spawns dp workers unless under torchrun)")
    _add_run_flags(train)
    est = sub.add_parser(
        "estimate", help="memory per rank of a run, predicted (nothing starts, nothing allocated)"
    )
    _add_run_flags(est)
    est.add_argument("--json", action="store_true", help="print JSON only (exact bytes)")
    est.add_argument(
        "--device-memory", type=float, metavar="GIB", help="fail (exit 2) if a rank needs more"
    )
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    sub.add_parser("presets", help="list model presets with their parameter counts")
    sched = sub.add_parser(
        "schedule", help="simulate a pipeline schedule (no model): bubble, memory, chart"
    )
    sched.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    sched.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    sched.add_argument(
        "--schedule", default="1f1b", help="naive, gpipe, 1f1b, interleaved, zb-h1, 2bw"
    )
    sched.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (v)")
    sched.add_argument("--out", default=None, help="folder for the PNG chart and trace JSON")
    _add_checkpoint_commands(sub)
    add_data_commands(sub)
    add_model_commands(sub)
    add_lessons_command(sub)
    return parser


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a run, shared by `train` and `estimate` (every train flag estimates)."""
    parser.add_argument("--config", help="TOML file with [model] [parallel] [data] [train]")
    parser.add_argument("--model", dest="preset", help="model preset (see `plait presets`)")
    for section, cls in SECTIONS.items():
        _add_section(parser, section, cls)


def _add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("checkpoint", help="inspect a checkpoint, or write it as one file")
    actions = ckpt.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="step, saving layout, model, tensors and bytes")
    info.add_argument("path", help="a checkpoint folder (OUT/checkpoints/step-N)")
    whole = actions.add_parser(
        "consolidate", help="the full fp32 model, any saving layout, as one safetensors file"
    )
    whole.add_argument("path", help="a checkpoint folder (OUT/checkpoints/step-N)")
    whole.add_argument("--out", required=True, help="the .safetensors file to write")


def _checkpoint(args: argparse.Namespace, err: Console) -> int:
    try:
        if args.action == "info":
            facts = inspect.info(Path(args.path))
            table = Table(title=f"checkpoint {facts.pop('path')}")
            table.add_column("field")
            table.add_column("value")
            for key, value in facts.items():
                table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
            Console().print(table)
        else:
            done = inspect.consolidate(Path(args.path), Path(args.out))
            Console().print(
                f"wrote {args.out}: {done['tensors']} tensors, {done['parameters']:,} "
                "fp32 parameters"
            )
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0


def _model_command(args: argparse.Namespace, err: Console) -> int:
    try:
        (export_main if args.command == "export" else generate_main)(args, Console())
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0


def config_from_args(args: argparse.Namespace, check_data: bool = True) -> Config:
    """Preset <- TOML <- flags, then validate (raises ConfigError); `check_data=False`
    leaves the corpus unread (the estimator needs only shapes)."""
    overrides: dict[str, dict[str, Any]] = load_toml(args.config) if args.config else {}
    overrides = {k: dict(v) for k, v in overrides.items()}
    toml_preset = overrides.get("model", {}).pop("preset", None)
    preset = args.preset or toml_preset
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    folder = overrides.get("train", {}).get("init_from")
    if folder:  # the model is the folder's: explicit model values must agree with it
        model = init_model(folder, overrides.pop("model", {}), preset)
        cfg = build_config(f"hf:{folder}", overrides, model)
    else:
        cfg = build_config(preset or "small-gpt", overrides)
    cfg.validate(check_data)
    if check_data and under_torchrun():  # every rank would otherwise fail alone, with a traceback
        cfg.parallel.layout.check_world(int(os.environ["WORLD_SIZE"]))
    return cfg


def _presets() -> int:
    from plait.models.presets import get_preset, preset_names
    from plait.models.transformer import count_parameters

    table = Table(title="plait model presets")
    for col in ("name", "parameters", "layers", "hidden", "heads", "kv heads", "vocab"):
        table.add_column(col)
    for name in preset_names():
        m = get_preset(name)
        table.add_row(
            name,
            f"{count_parameters(m):,}",
            str(m.n_layers),
            str(m.d_model),
            str(m.n_heads),
            str(m.kv_heads),
            str(m.vocab_size),
        )
    Console().print(table)
    return 0


def _schedule(args: argparse.Namespace, err: Console) -> int:

    from plait.parallel.pipeline.output.schedule_cli import schedule_main

    out = Path(args.out) if args.out else None
    try:
        schedule_main(args.pp, args.microbatches, args.schedule, args.virtual_stages, out)
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0


def _estimate(args: argparse.Namespace, err: Console) -> int:
    from plait.estimate import estimate
    from plait.estimate.render import print_estimate, print_json

    try:
        cfg = config_from_args(args, check_data=False)
        est = estimate(cfg)
    except ConfigError as e:
        return print_bad_input(err, e)
    print_json(est) if args.json else print_estimate(est, Console())
    budget = args.device_memory
    worst = est.most_loaded
    if budget is not None and worst.total() > budget * 2**30:
        biggest = max(worst.lines, key=lambda line: line.device)
        err.print(
            f"[bold red]plait: error:[/] nothing fits: pipeline stage {worst.pp_rank} needs "
            f"{worst.total() / 2**30:,.2f} GiB on the device, more than --device-memory "
            f"{budget:g} GiB (largest term: {biggest.name} {biggest.device / 2**30:,.2f} GiB)",
            highlight=False,
        )
        return 2
    return 0


def _planning(args: argparse.Namespace, err: Console) -> int:
    from plait.calibrate import run_calibrate
    from plait.plan.command import run_plan

    try:
        return run_plan(args, err) if args.command == "plan" else run_calibrate(args)
    except ConfigError as e:
        return print_bad_input(err, e)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "presets":
        return _presets()
    err = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    if args.command == "schedule":
        return _schedule(args, err)
    if args.command == "checkpoint":
        return _checkpoint(args, err)
    if args.command in DATA_COMMANDS:
        return run_data_command(args, err)
    if args.command == "estimate":
        return _estimate(args, err)
    if args.command in ("plan", "calibrate"):
        return _planning(args, err)
    if args.command in ("export", "generate"):
        return _model_command(args, err)
    if args.command == "lessons":
        return lessons_main(args, err)
    try:
        cfg = config_from_args(args)
        out = Path(cfg.train.out)
        start = resolve(cfg.train.resume, out) if cfg.train.resume else None
        if start is not None:
            check_resumable(start, cfg.to_dict())
        if not under_torchrun() or os.environ.get("RANK") == "0":  # one rank owns the folder
            prepare_out(out, cfg.train.overwrite, bool(cfg.train.resume))
    except ConfigError as e:
        return print_bad_input(err, e)
    if cfg.parallel.precision == "fp16" and device_kind(cfg.train.device) == "cpu":
        err.print(
            "[yellow]plait: warning:[/] fp16 on a CPU runs about 10x slower than fp32 "
            "(torch's CPU fp16 matmul); --precision bf16 is fast here",
            highlight=False,
        )
    try:
        launch(cfg)
    except WorkerFailure as e:
        err.print("[bold red]plait: a worker failed; all ranks stopped.[/]")
        err.print(str(e), markup=False, highlight=False)
        return 1
    except Interrupted as e:
        if e.forced:
            err.print("[bold]plait: stopped at once; every rank ended, no checkpoint.[/]")
        return 128 + e.signum
    except KeyboardInterrupt:
        err.print("[bold]plait: interrupted; every rank stopped.[/]")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
