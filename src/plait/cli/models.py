"""The model-interchange commands: `plait export`, `plait generate`, and `--init-from`.

Kept apart from cli/train.py so the training command line stays one page. Each handler validates
everything (files, configs, lengths) before reading weights, and answers bad input with one
line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from plait.checkpoint import inspect, store
from plait.data.examples import is_examples_dir
from plait.data.instruct import Tokenized
from plait.data.shards import is_shard_dir, shard_tokenizer
from plait.data.stream import data_tokenizer
from plait.data.tokenizer import TokenizerSpec, resolve_tokenizer, text_tokenizer
from plait.domain import above, at_least
from plait.errors import ConfigError, print_bad_input
from plait.models.architecture import ModelConfig
from plait.models.generate import Sampling, complete, stop_ids
from plait.models.hf.export import check_out, write_folder
from plait.models.hf.load import hf_source, load_config
from plait.models.hf.peft import (
    adapter_model_fields,
    adapter_source,
    check_adapter,
    read_adapter_config,
    save_adapter,
)
from plait.models.init import fill_parameters, with_adapters
from plait.models.lora import merge_adapters, parse_targets
from plait.models.transformer import Transformer

# Training choices, not the architecture: an explicit value never conflicts with a folder
# (LoRA's adapters are added to the folder's model, which stays their frozen base; LoRA's
# fields may conflict with an --adapter's: `apply_adapter`).
FREE_MODEL_FIELDS = frozenset({"dropout", "lora_rank", "lora_alpha", "lora_dropout",
                               "lora_targets"})  # fmt: skip
PEFT_FIELDS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
               "lora_targets": "target_modules"}  # fmt: skip
"""ModelConfig's LoRA fields -> the adapter_config.json field each comes from."""


MOVED_BASE = "a LoRA checkpoint's base folder, where it moved (its SHA-256 is checked)"


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder")
    exp.add_argument("--checkpoint", required=True, help="a checkpoint folder, or a run's OUT")
    exp.add_argument(
        "--format", choices=("hf", "peft"), default="hf",
        help="hf: config.json + safetensors; peft: a LoRA run's adapters as PEFT writes them",
    )  # fmt: skip
    exp.add_argument("--out", required=True, help="the folder to write (must not exist)")
    exp.add_argument(
        "--merge", action="store_true",
        help="a LoRA checkpoint: write the base with its adapters merged (W + alpha/r B A)",
    )  # fmt: skip
    exp.add_argument(
        "--max-shard-mb", type=above(0), default=2048.0, help="largest safetensors file"
    )
    exp.add_argument("--init-from", help=MOVED_BASE)
    gen = sub.add_parser("generate", help="continue a prompt with a trained model (one process)")
    gen.add_argument("--checkpoint", help="a checkpoint folder, or OUT to use its latest")
    gen.add_argument(
        "--init-from", help="a Hugging Face Llama/GPT-2 folder; with --checkpoint: " + MOVED_BASE
    )
    gen.add_argument("--adapter", help="with --init-from: a PEFT LoRA adapter folder for it")
    gen.add_argument("--prompt", required=True, help="the text to continue, or the instruction")
    gen.add_argument("--template", help="alpaca: answer --prompt in Stanford's prompt template")
    gen.add_argument("--input", help="--template alpaca's input (context) field")
    gen.add_argument(
        "--chat", action="store_true", help="answer --prompt as a user turn (the chat template)"
    )
    gen.add_argument("--system", help="--chat: a system message before the user's")
    gen.add_argument("--chat-template", help="--chat: a Jinja file instead of the tokenizer's")
    gen.add_argument("--max-new-tokens", type=at_least(1), default=64, help="tokens to generate")
    gen.add_argument(
        "--temperature", type=at_least(0, float), default=0.0, help="0: greedy (default)"
    )
    gen.add_argument(
        "--top-k", type=at_least(0), default=0, help="sample among the k likeliest; 0: all"
    )
    gen.add_argument("--seed", type=at_least(0), default=0, help="seed of the sampling generator")


def checkpoint_path(given: str) -> Path:
    """A checkpoint folder, or a run's output folder (its newest checkpoint): the store's
    one rule, shared with `train --resume` and `checkpoint info|consolidate`."""
    return store.complete(Path(given))


def init_model(
    folder: str, explicit: dict[str, Any], preset: str | None, adapter: str = ""
) -> ModelConfig:
    """`--init-from`'s model config; explicit model flags must agree with it (dropout and
    LoRA's aside) and LoRA's with `--adapter`'s folder, whose rank and targets it takes."""
    if preset:
        raise ConfigError(f"--model {preset} and --init-from {folder} both name the model")
    cfg = load_config(Path(folder))
    for key, value in explicit.items():
        if key in FREE_MODEL_FIELDS:
            setattr(cfg, key, value)
        elif not hasattr(cfg, key):
            raise ConfigError(f"unknown key {key!r} in [model]")
        elif getattr(cfg, key) != value:
            raise ConfigError(
                f"model.{key}={value!r} conflicts with model.{key}={getattr(cfg, key)!r} "
                f"from --init-from {folder}"
            )
    if adapter:
        apply_adapter(cfg, adapter, explicit)
    return cfg


def init_tokenizer(folder: str, path: str | None, given: str | None) -> str | None:
    """The tokenizer a run from `--init-from folder` reads `--data path` with. A folder with
    a tokenizer.json speaks its ids: raw text is tokenized with it (not as bytes, which would
    feed a 32K-token model ids 0-255), and a --tokenizer or text shards made with another
    tokenizer are refused, naming both (instruction examples: `check_examples`). A folder
    without one leaves `given` (bytes if none) as it is."""
    if not (Path(folder) / "tokenizer.json").is_file():
        return given
    own = resolve_tokenizer(folder)
    if is_examples_dir(path):
        return given
    if is_shard_dir(path):
        made = shard_tokenizer(path, None)
        if made.identity != own.identity:
            raise ConfigError(
                f"shards {path!r} were made with tokenizer {made.name}"
                + (f" (sha256 {made.identity})" if made.identity else "")
                + f", not with --init-from {folder}'s; prepare them again with --tokenizer {folder}"
            )
        return given
    if given and resolve_tokenizer(given).identity != own.identity:
        raise ConfigError(
            f"--tokenizer {given} is not --init-from {folder}'s tokenizer (sha256 "
            f"{resolve_tokenizer(given).identity} vs {own.identity}): the model's ids are its "
            "own tokens; leave --tokenizer out"
        )
    return given or folder


def apply_adapter(cfg: ModelConfig, adapter: str, explicit: dict[str, Any]) -> None:
    """Set `cfg`'s LoRA fields from a PEFT folder's adapter_config.json (an explicit value
    that disagrees is refused, naming both) and check its tensors against the base's shapes."""
    folder = Path(adapter)
    config = read_adapter_config(folder)
    fields = adapter_model_fields(config, cfg, str(folder / "adapter_config.json"))
    for key, value in fields.items():
        if key in explicit and not _same(key, explicit[key], value, cfg.arch):
            theirs = PEFT_FIELDS[key]
            raise ConfigError(
                f"model.{key}={explicit[key]!r} conflicts with {theirs}="
                f"{config.get(theirs, value)!r} from --adapter {adapter}"
            )
        setattr(cfg, key, value)
    cfg.validate()
    check_adapter(folder, cfg)


def _same(key: str, given: Any, implied: Any, arch: str) -> bool:
    """Whether an explicit LoRA value means what the adapter's does ('all' is the list)."""
    if key == "lora_targets":
        return parse_targets(given, arch) == parse_targets(implied, arch)
    return given == implied


def run_tokenizer(checkpoint: Path, hint: str = "") -> TokenizerSpec:
    """The tokenizer the checkpointed run trained with (bytes, or its tokenizer.json), found
    through the run's data and checked against the SHA-256 the run recorded: data that moved
    (the run's paths are relative to where it started) would otherwise pass for bytes."""
    data = store.read_trainer(checkpoint)["config"]["data"]
    spec = data_tokenizer(data.get("path"), data.get("tokenizer"))
    recorded = data.get("tokenizer_hash", spec.identity)
    if spec.identity != recorded:
        raise ConfigError(
            f"the run of checkpoint {checkpoint} trained with tokenizer sha256 {recorded}, but "
            f"its data {data.get('path')!r} now gives {spec.name} (sha256 {spec.identity}): run "
            f"from the folder the run started in (its paths are relative to it){hint}"
        )
    return spec


def export_main(args: argparse.Namespace, console: Console) -> None:
    """`plait export`: the checked target, then the writer of `--format`."""
    out = Path(args.out)
    check_out(out)
    if args.max_shard_mb <= 0:
        raise ConfigError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    path = checkpoint_path(args.checkpoint)
    if args.init_from:  # checked before anything is read or written
        inspect.checked_base(path, store.read_trainer(path), args.init_from)
    (export_peft if args.format == "peft" else export_hf)(path, out, args, console)


def export_hf(path: Path, out: Path, args: argparse.Namespace, console: Console) -> None:
    """`--format hf`: the model as a Hugging Face folder; a LoRA checkpoint only merged
    (`--merge`: base names only, each targeted W + scaling B A; the base read from the
    source the checkpoint names), since transformers' folder has no place for adapters."""
    cfg = inspect.model_config(path)
    if cfg.lora is not None and not args.merge:
        raise ConfigError(
            f"checkpoint {path} holds LoRA adapters (rank {cfg.lora_rank}): add --merge to "
            "write the merged model, or use --format peft for the adapters alone"
        )
    if args.merge and cfg.lora is None:
        raise ConfigError(
            f"--merge: checkpoint {path} has no LoRA adapters to merge (trained without "
            "--lora-rank); leave out --merge"
        )
    spec = run_tokenizer(path)
    tokenizer = (Path(spec.path), spec.eos_id) if spec.path else None
    params, limit = inspect.read_params(path, args.init_from), int(args.max_shard_mb * 2**20)
    if args.merge:
        params, cfg = merge_adapters(cfg, params), replace(cfg, lora_rank=None)
    done = write_folder(cfg, params, out, limit, tokenizer)
    merged = " (adapters merged)" if args.merge else ""
    console.print(
        f"wrote {out}: {done['architecture']}{merged}, {done['tensors']} tensors in "
        f"{done['files']} safetensors file(s)"
    )


def export_peft(path: Path, out: Path, args: argparse.Namespace, console: Console) -> None:
    """A LoRA checkpoint's adapters as a PEFT folder for the base its run started from."""
    if args.merge:
        raise ConfigError(
            "--merge writes the merged model (--format hf); --format peft writes the adapters "
            "alone: leave out one of them"
        )
    cfg = inspect.model_config(path)
    if cfg.lora is None:
        raise ConfigError(
            f"--format peft: checkpoint {path} has no LoRA adapters (its run had no "
            "--lora-rank); export the whole model with --format hf"
        )
    base = args.init_from or store.read_trainer(path)["config"]["train"].get("init_from") or ""
    save_adapter(out, cfg, inspect.read_masters(path), base)
    console.print(
        f"wrote {out}: a PEFT LoRA adapter (r={cfg.lora_rank}, targets "
        f"{cfg.lora_targets or 'default'}) for {base or 'the seeded base of its run'}"
    )


def generate_main(args: argparse.Namespace, console: Console) -> None:
    """Continue `--prompt` and print the prompt and the continuation, or with --template or
    --chat answer it (stopping at `stop_ids`) and print the response alone; plain text
    (`print_completion`); `console` is unused here (rich is for messages). Every flag, the
    tokenizer and the template are checked before the weights are read."""
    if not (args.checkpoint or args.init_from):
        raise ConfigError("plait generate needs a model: --checkpoint CK or --init-from HF_DIR")
    if args.adapter and (args.checkpoint or not args.init_from):
        raise ConfigError(
            f"--adapter {args.adapter} goes with --init-from BASE (the model it adapts); "
            "a checkpoint holds its run's adapters"
        )
    fmt = check_template_flags(args)
    spec = generator_tokenizer(args)
    sampling = Sampling(args.temperature, args.top_k, args.seed)
    if fmt is None:
        model = load_generator(args)
        text = complete(model, text_tokenizer(spec), args.prompt, args.max_new_tokens, sampling)
        print_completion(args.prompt + text)
        return
    if spec.path is None:
        raise ConfigError(
            f"{'--chat' if fmt == 'chat' else '--template alpaca'} needs a tokenizer with an "
            "end-of-sequence token; the byte tokenizer has none"
        )
    prompt = Tokenized(fmt, spec, args.chat_template, flag="--chat").prompt_ids(
        instruction_fields(args)
    )
    stop = stop_ids(spec.eos_id, stop_folder(args))
    model = load_generator(args)
    text = complete(model, text_tokenizer(spec), prompt, args.max_new_tokens, sampling, stop)
    print_completion(text)


TEMPLATES = ("alpaca",)


def stop_folder(args: argparse.Namespace) -> str | None:
    """The model folder whose generation_config.json names the stop ids: `--init-from`, or
    the folder the checkpointed run started from (its own --init-from), if any."""
    if args.init_from:
        return args.init_from
    config = store.read_trainer(checkpoint_path(args.checkpoint))["config"]
    return config.get("train", {}).get("init_from") or None


def check_template_flags(args: argparse.Namespace) -> str | None:
    """The instruction format --template/--chat ask for (None: continue raw text);
    ConfigError for a combination that means nothing."""
    if args.template is not None and args.chat:
        raise ConfigError(f"--template {args.template} and --chat both name the prompt format")
    if args.template is not None and args.template not in TEMPLATES:
        known = ", ".join(TEMPLATES)
        raise ConfigError(f"unknown --template {args.template!r} (known: {known}; or --chat)")
    if args.input is not None and args.template != "alpaca":
        raise ConfigError("--input is alpaca's input field: it needs --template alpaca")
    for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and not args.chat:
            raise ConfigError(f"{flag} is for chat prompts: it needs --chat")
    return "chat" if args.chat else args.template


def instruction_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The record `prompt_ids` reads: alpaca's fields, or the chat's messages."""
    if not args.chat:
        return {"instruction": args.prompt, "input": args.input}
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return {"messages": [*system, {"role": "user", "content": args.prompt}]}


def generator_tokenizer(args: argparse.Namespace) -> TokenizerSpec:
    """The tokenizer of `--checkpoint` (its run's) or `--init-from` (the folder's own
    tokenizer.json, else bytes)."""
    if args.checkpoint:
        return run_tokenizer(checkpoint_path(args.checkpoint))
    folder = Path(args.init_from)
    return resolve_tokenizer(folder if (folder / "tokenizer.json").is_file() else None)


def load_generator(args: argparse.Namespace) -> Transformer:
    """The model of `--checkpoint` or `--init-from` (with `--adapter`'s adapters)."""
    if args.checkpoint:  # --init-from beside it: a LoRA checkpoint's base, moved
        return inspect.load_model(checkpoint_path(args.checkpoint), args.init_from)
    folder = Path(args.init_from)
    cfg = load_config(folder)
    if args.adapter:
        apply_adapter(cfg, args.adapter, {})
    source = hf_source(folder, cfg)
    if args.adapter:
        source = with_adapters(source, cfg, 0, adapter_source(Path(args.adapter), cfg))
    model = Transformer(cfg)
    fill_parameters(model, source)
    return model


def print_completion(text: str) -> None:
    """Write exactly `text` and one newline to stdout. Not through rich: its console
    hard-wraps at 80 columns when piped (dropping the space at the break), turns
    `:thumbs_up:` into an emoji and drops control characters, all of which the model may
    have written and a caller piping the output must get back as decoded."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        (export_main if args.command == "export" else generate_main)(args, Console())
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0
