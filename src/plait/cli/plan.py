"""`plait plan`: the arguments, the checks that name the numbers, and the run."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from plait.composition import check_tensor_parallel
from plait.domain import at_least, fraction
from plait.errors import ConfigError, print_bad_input
from plait.mixed_precision import check_base_dtype, parse_precision
from plait.models.architecture import ModelConfig
from plait.models.lora import check_given_targets
from plait.models.presets import get_preset
from plait.outdir import check_out_file
from plait.plan.enumerate import Request, divisors, shapes
from plait.plan.hardware import load_hardware, parse_size
from plait.plan.headroom import add_headroom_flag, headroom_bytes
from plait.plan.ranking import budget_words, dropped_line, print_plan, wide_console
from plait.plan.search import Plan, plan
from plait.plan.toml_out import write_plan


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="rank the layouts of a model on a cluster by predicted step time"
    )
    p.add_argument("--model", default="small-gpt", help="model preset (see `plait presets`)")
    p.add_argument("--gpus", type=at_least(1), required=True, help="devices in all")
    p.add_argument("--gpus-per-node", type=at_least(1), help="devices per node (default: all)")
    p.add_argument("--gpu-memory", help="device memory, e.g. 80GiB (default: the hardware's)")
    add_headroom_flag(p)
    p.add_argument("--global-batch", type=at_least(1), required=True, help="sequences per step")
    p.add_argument("--seq-len", type=at_least(1), required=True, help="tokens per sequence")
    p.add_argument("--hardware", default="h100", help="h100, a100, cpu or a profile's file")
    p.add_argument("--precision", help="fp32, bf16 or fp16 (default: the hardware's)")
    p.add_argument(
        "--max-micro-batch", type=at_least(1), default=8, help="largest micro-batch tried"
    )
    p.add_argument("--offload-dir", help="also consider NVMe offload, to this folder")
    p.add_argument("--lora-rank", type=at_least(1), help="plan a LoRA run of this rank")
    p.add_argument("--lora-targets", help="LoRA targets (default PEFT's; docs/lora.md)")
    p.add_argument("--lora-dropout", type=fraction(), help="dropout on the adapters' input")
    p.add_argument("--base-dtype", default="auto", help="LoRA's frozen base: auto, bf16, fp32, nf4")
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=at_least(1), help=f"only layouts with this {axis}")
    p.add_argument("--top", type=at_least(1), default=8, help="layouts shown")
    p.add_argument("--out", help="write the best layout as a TOML config for plait train")


def request_of(args: argparse.Namespace, precision: str) -> Request:
    """The request, after the checks that need no enumeration (each names its numbers)."""
    model = lora_model(args, get_preset(args.model))
    parse_precision(precision)
    per_node = args.gpus_per_node or args.gpus  # each >= 1: their flags' domains
    if args.gpus % per_node:
        raise ConfigError(
            f"--gpus {args.gpus} is not a multiple of --gpus-per-node {per_node}: the planner "
            "places whole nodes of equal size"
        )
    fixed = tuple((a, getattr(args, a)) for a in ("dp", "tp", "pp") if getattr(args, a))
    req = Request(
        model,
        args.model,
        args.gpus,
        per_node,
        args.global_batch,
        args.seq_len,
        precision,
        args.max_micro_batch,
        args.offload_dir,
        fixed,
        args.base_dtype,
    )
    check_pins(req)
    return req


def lora_model(args: argparse.Namespace, model: ModelConfig) -> ModelConfig:
    """The preset with the LoRA flags applied and checked (flags that need a rank refused
    without one, as `plait train` refuses them)."""
    given = [f for f in ("lora_targets", "lora_dropout") if getattr(args, f) is not None]
    if args.lora_rank is None:
        if given or args.base_dtype != "auto":
            flags = ", ".join("--" + f.replace("_", "-") for f in given or ["base_dtype"])
            raise ConfigError(f"{flags} given without --lora-rank: plan a LoRA run with both")
        return model
    model.lora_rank = args.lora_rank
    if args.lora_targets is not None:
        check_given_targets(args.lora_targets)
    model.lora_targets = args.lora_targets or ""
    if args.lora_dropout is not None:
        model.lora_dropout = args.lora_dropout
    model.validate()
    check_base_dtype(args.base_dtype)
    return model


def _nearest(value: int, valid: list[int]) -> str:
    near = sorted(valid, key=lambda v: (abs(v - value), v))[:2]
    return " or ".join(str(v) for v in sorted(near)) or "none"


def check_pins(req: Request) -> None:
    """A pinned axis that cannot work fails naming the numbers and the nearest that can."""
    m, pins = req.model, dict(req.fixed)
    if "tp" in pins:
        ok = [t for t in divisors(m.n_heads) if _splits(req, t)]
        try:
            check_tensor_parallel(m, pins["tp"])
        except ConfigError as e:
            raise ConfigError(f"{e}; the nearest tp that work: {_nearest(pins['tp'], ok)}") from e
        if pins["tp"] > req.gpus_per_node:
            raise ConfigError(
                f"tp={pins['tp']} is more than --gpus-per-node {req.gpus_per_node}: tensor "
                "parallelism must stay within a node (it all-reduces activations in every "
                f"layer); the nearest tp that work: {_nearest(pins['tp'], ok)}"
            )
    if "pp" in pins and m.n_layers % pins["pp"]:
        ok = [p for p in divisors(m.n_layers) if req.gpus % p == 0]
        raise ConfigError(
            f"{m.n_layers} layers do not split evenly into pp={pins['pp']} stages; the nearest "
            f"pp that do (and divide {req.gpus} GPUs): {_nearest(pins['pp'], ok)}"
        )
    prod = 1
    for v in pins.values():
        prod *= v
    if req.gpus % prod:
        axes = " x ".join(f"{a}={v}" for a, v in req.fixed)
        raise ConfigError(f"{axes} = {prod} does not divide --gpus {req.gpus}")
    if "dp" in pins and req.global_batch % pins["dp"]:
        ok = [d for d in divisors(req.gpus) if req.global_batch % d == 0]
        raise ConfigError(
            f"global batch {req.global_batch} is not divisible by dp={pins['dp']}; the nearest "
            f"dp that divide it (and {req.gpus} GPUs): {_nearest(pins['dp'], ok)}"
        )
    if next(shapes(req), None) is None:
        raise ConfigError(
            f"no layout of {req.preset} ({m.n_layers} layers, {m.n_heads} heads) divides "
            f"{req.gpus} GPUs and global batch {req.global_batch}"
            + (f" with {', '.join(f'{a}={v}' for a, v in req.fixed)}" if req.fixed else "")
        )


def _splits(req: Request, tp: int) -> bool:
    try:
        check_tensor_parallel(req.model, tp)
    except ConfigError:
        return False
    return req.gpus % tp == 0 and tp <= req.gpus_per_node


def nothing_fits(out: Plan) -> str:
    """The one-line error when no layout fits, naming the closest and what they need."""
    seen, closest = set(), []
    for d in out.dropped:
        if d.candidate.shape not in seen:
            seen.add(d.candidate.shape)
            closest.append(dropped_line(d, out))
    return (
        f"nothing fits: none of {out.considered:,} layouts of {out.request.preset} on "
        f"{out.request.gpus} devices fits in {budget_words(out)}; the closest: "
        + "; ".join(closest[:3])
    )


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        return run_plan(args)
    except ConfigError as e:
        return print_bad_input(err, e)


def run_plan(args: argparse.Namespace) -> int:
    hw = load_hardware(args.hardware)
    memory = parse_size(args.gpu_memory) if args.gpu_memory else hw.memory
    headroom = headroom_bytes(args.memory_headroom, memory)
    req = request_of(args, args.precision or hw.precision)
    if args.out:
        check_out_file(Path(args.out))
    out = plan(req, hw, memory, args.top, headroom)
    if not out.ranked:
        raise ConfigError(nothing_fits(out))
    print_plan(out, wide_console(), args.top)
    if args.out:
        write_plan(out, args.out)
        Console().print(f"wrote {args.out}: plait train --config {args.out}", highlight=False)
    return 0
