"""A LoRA checkpoint's base: named, not copied; checked on resume; read back for its values.

A LoRA run trains only its adapters, so its checkpoint holds only them (with their optimizer
state and the sampler, like any checkpoint: the engines save their trainable parameters
alone, and the contract makes everything else frozen). The frozen base is named instead, in
the trainer state:

    "base": {"init_from": the --init-from folder (absolute) or None,
             "sha256": SHA-256 of that folder's config.json and weight files, or None,
             "seed": the seed (which made the base when there is no folder),
             "quantization": "nf4" for a QLoRA run (`--base-dtype nf4`; absent otherwise)}

The hash covers the full bytes of `config.json`, `model.safetensors.index.json` (if any)
and every `*.safetensors` file, in name order, each with its name and size: about 1.7 GB/s
on one core, so some 8 s for llama-7b in bf16 (13.5 GB), computed once per run start by the
command before any worker starts (`checkpoint.init_from_sha256`; under torchrun, each rank's
command), about what reading the weights costs anyway. Headers alone would be cheaper but
would miss a retrained folder of the same shapes, which is exactly the mistake the record is
there to catch.

Reading a LoRA checkpoint's model (`inspect.read_params`: sampling at the end of a run,
`generate`, `export`; `plait eval --checkpoint` builds its base the same way) takes the base
from the recorded source, checked against the hash, and the adapters from the checkpoint. A
base folder that moved is named again with `--init-from NEWDIR` (`relocated`: the same hash
is required), for `generate`, `eval`, `export --merge` and `train --resume` alike.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

BASE_FILES = ("config.json", "model.safetensors.index.json")


def folder_sha256(folder: Path) -> str:
    """SHA-256 over a Hugging Face folder's config.json, index and safetensors files (each
    file's name, size and bytes, in name order); what a LoRA checkpoint's adapters need."""
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and (p.name in BASE_FILES or
                                                        p.suffix == ".safetensors")
    )  # fmt: skip
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def base_record(config: dict[str, Any]) -> dict[str, Any] | None:
    """The base a run's adapters need, from its `Config.to_dict()` (None without LoRA).
    The folder's hash is the one the command recorded (`checkpoint.init_from_sha256`), else
    computed here (a run built without the command: tests, the lessons)."""
    if config["model"].get("lora_rank") is None:
        return None
    train, ckpt = config["train"], config["checkpoint"]
    folder = ckpt.get("init_from") or None
    nf4 = {"quantization": "nf4"} if config["lora"].get("base_dtype") == "nf4" else {}
    if folder is None:
        return {"init_from": None, "sha256": None, "seed": train["seed"], **nf4}
    sha = ckpt.get("init_from_sha256") or folder_sha256(Path(folder))
    return {"init_from": str(Path(folder).resolve()), "sha256": sha, "seed": train["seed"]} | nf4


def saved_base(state: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's recorded base (None: no adapters); a LoRA checkpoint from before the
    record names its base through its config, unhashed."""
    if state["config"]["model"].get("lora_rank") is None:
        return None
    if "base" in state:
        return state["base"]
    config = state["config"]  # today's sections (`store.read_trainer`)
    folder = config["checkpoint"].get("init_from")
    return {"init_from": folder or None, "sha256": None, "seed": config["train"]["seed"]}


def describe(base: dict[str, Any]) -> str:
    """`--init-from /path (sha256 1a2b3c4d5e6f...)` or `the seeded init (seed 0)`, with
    `, quantized to NF4` for a QLoRA base."""
    nf4 = ", quantized to NF4" if base.get("quantization") == "nf4" else ""
    if base["init_from"] is None:
        return f"the seeded init (seed {base['seed']}){nf4}"
    sha = f" (sha256 {base['sha256'][:12]}...)" if base["sha256"] else ""
    return f"--init-from {base['init_from']}{sha}{nf4}"


def same_base(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Two records name the same base: the same folder content (a moved folder is the same
    base), or the same seed for a seeded one; quantized alike (NF4 or not)."""
    if (saved["init_from"] is None) != (now["init_from"] is None):
        return False
    if saved.get("quantization") != now.get("quantization"):
        return False
    if saved["init_from"] is None:
        return saved["seed"] == now["seed"]
    if saved["sha256"] and now["sha256"]:
        return saved["sha256"] == now["sha256"]
    return Path(saved["init_from"]).resolve() == Path(now["init_from"]).resolve()


def targets_text(model: dict[str, Any]) -> str:
    """`'q,v'` as given, or `PEFT's default` for '' (a config's `model` section)."""
    return repr(model["lora_targets"]) if model.get("lora_targets") else "PEFT's default"


def _adapters(model: dict[str, Any]) -> str:
    if model.get("lora_rank") is None:
        return "no adapters (full fine-tuning)"
    return (
        f"LoRA adapters of rank {model['lora_rank']}, targets {targets_text(model)}, "
        f"alpha {model.get('lora_alpha')}"
    )


def check_same_adapters_and_base(path: Path, state: dict[str, Any], config: dict[str, Any]) -> None:
    """A resumed run keeps the saved run's adapters (rank, targets, alpha) and their base;
    ConfigError naming both otherwise (checked before any worker starts)."""
    saved, now = state["config"]["model"], config["model"]
    keys = ("lora_rank", "lora_targets", "lora_alpha")
    if any(saved.get(k) != now.get(k) for k in keys):
        raise ConfigError(
            f"checkpoint {str(path)!r} holds {_adapters(saved)}; this run asks for "
            f"{_adapters(now)} (a resumed run keeps its adapters; start a new --out to "
            "train others)"
        )
    was, base = saved_base(state), base_record(config)
    if was is not None and base is not None and not same_base(was, base):
        raise ConfigError(
            f"checkpoint {str(path)!r} holds adapters trained on {describe(was)}; this run's "
            f"base is {describe(base)} (resume on the base the adapters were trained on)"
        )


def relocated(path: Path, base: dict[str, Any], folder: str) -> dict[str, Any]:
    """The checkpoint's base read from `folder` (`--init-from NEWDIR`: the base folder moved):
    the same record with the new place, once the folder's hash is the recorded one (a record
    from before the hash is taken at its word). ConfigError naming both otherwise."""
    if base["init_from"] is None:
        raise ConfigError(
            f"checkpoint {str(path)!r} holds adapters trained on {describe(base)}, not on a "
            f"model folder: --init-from {folder} names no base of it; leave it out"
        )
    if not Path(folder).is_dir():
        raise ConfigError(f"--init-from {folder} is not a folder (the base model's new place)")
    found = folder_sha256(Path(folder))
    if base["sha256"] and found != base["sha256"]:
        raise ConfigError(
            f"--init-from {folder} holds other weights (sha256 {found[:12]}...) than the base "
            f"the adapters of checkpoint {str(path)!r} were trained on, {describe(base)}"
        )
    return {**base, "init_from": str(Path(folder).resolve()), "sha256": found}


def check_available(path: Path, base: dict[str, Any]) -> None:
    """The recorded base folder is there and holds what it held (ConfigError naming both)."""
    if base["init_from"] is None:
        return
    folder = Path(base["init_from"])
    if not folder.is_dir():
        raise ConfigError(
            f"checkpoint {str(path)!r} holds LoRA adapters whose base {describe(base)} is not "
            "there any more (the checkpoint names its base instead of copying it); if it "
            "moved, give its new place with --init-from NEWDIR"
        )
    found = folder_sha256(folder) if base["sha256"] else None
    if found is not None and found != base["sha256"]:
        raise ConfigError(
            f"checkpoint {str(path)!r} holds LoRA adapters trained on {describe(base)}; that "
            f"folder now holds other weights (sha256 {found[:12]}...)"
        )
