"""Checkpoint folders: `OUT/checkpoints/step-N/`, committed atomically, the newest found.

A save writes every rank's boxes with `torch.distributed.checkpoint` (each rank its own
file, in parallel), then rank 0 writes `trainer.json` (step, sampler, loss scaler, config),
a `manifest.json` with the size and SHA-256 of every file, and last the `COMMITTED` marker.
A folder without the marker is a save that did not finish (a crash, a kill): it is never
loaded, only reported, and the next save of the same step replaces it. Only the newest
`keep` committed checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from plait.checkpoint.base import check_same_adapters_and_base
from plait.config import saved_config
from plait.errors import ConfigError

MARKER = "COMMITTED"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step}"


def committed(path: Path) -> bool:
    return (path / MARKER).is_file()


def write_manifest(path: Path, trainer_state: dict[str, Any]) -> int:
    """trainer.json, the manifest and the commit marker (rank 0, after every rank wrote);
    returns the checkpoint's bytes."""
    (path / TRAINER).write_text(json.dumps(trainer_state, indent=2))
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    entries = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in files}  # fmt: skip
    (path / MANIFEST).write_text(json.dumps(entries, indent=2))
    (path / MARKER).write_text("complete\n")
    return sum(e["bytes"] for e in entries.values())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path) -> None:
    """Every file the manifest lists is there, with its size and checksum (a manifest that
    is missing or cannot be read is damage too, one line like the rest)."""
    entries = _read_json(path, MANIFEST)
    for name, entry in entries.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise ConfigError(f"checkpoint {str(path)!r} is damaged: {name} is missing or cut")
        if _sha256(file) != entry["sha256"]:
            raise ConfigError(f"checkpoint {str(path)!r} is damaged: {name} fails its checksum")


def latest(out: Path, warn: bool = True) -> Path | None:
    """The newest committed checkpoint under `out/checkpoints` (warning about newer partial
    ones unless `warn` is False)."""
    root = out / "checkpoints"
    found = sorted(root.glob("step-*"), key=_step_of) if root.is_dir() else []
    for path in reversed(found):
        if committed(path):
            return path
        if warn:
            print(f"plait: warning: ignoring {path}: the save did not finish (no {MARKER})",
                  file=sys.stderr)  # fmt: skip
    return None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return -1


def resolve(resume: str, out: Path) -> Path | None:
    """`--resume latest` (None when there is none yet: the first start of a run that may
    restart) or a path: a committed checkpoint folder, or a run's output folder (its newest
    committed checkpoint)."""
    return latest(out) if resume == "latest" else complete(Path(resume))


def complete(path: Path) -> Path:
    """The checkpoint `path` names, if its save finished: `path` itself, or, for a run's
    output folder (`checkpoints/` or `summary.json` inside), its newest committed checkpoint.
    The one home of that rule for every command that takes a checkpoint; ConfigError naming
    what `path` is otherwise."""
    if path.is_file():
        raise ConfigError(f"checkpoint {str(path)!r} is a file; give a checkpoint folder")
    if not path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    if committed(path):
        return path
    if (path / "checkpoints").is_dir() or (path / "summary.json").is_file():
        newest = latest(path)
        if newest is None:
            raise ConfigError(
                f"the run {str(path)!r} has no checkpoint (trained with --no-save, or no save "
                "finished)"
            )
        return newest
    if (path / TRAINER).is_file() or path.name.startswith("step-"):
        raise ConfigError(f"checkpoint {str(path)!r}: the save did not finish (no {MARKER})")
    raise ConfigError(
        f"{str(path)!r} is neither a checkpoint (OUT/checkpoints/step-N, with {MARKER}) "
        "nor a run folder (OUT, with checkpoints/)"
    )


def read_trainer(path: Path) -> dict[str, Any]:
    """The checkpoint's trainer state, its config in today's sections (`saved_config`: a
    checkpoint saved before the split into concerns reads the same); a missing or unreadable
    trainer.json is damage, one line (a command may read it before it verifies the
    checkpoint: `generate`'s tokenizer)."""
    state = _read_json(path, TRAINER)
    if isinstance(state.get("config"), dict):
        state["config"] = saved_config(state["config"])
    return state


def _read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads((path / name).read_text())
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {str(path)!r} is damaged: {name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        what = e.strerror if isinstance(e, OSError) else "not JSON"
        raise ConfigError(f"checkpoint {str(path)!r} is damaged: {name}: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"checkpoint {str(path)!r} is damaged: {name}: not a JSON object")
    return data


KEPT = (("train", "global_batch"), ("train", "seq_len"), ("train", "seed"), ("data", "path"),
        ("data", "max_bytes"), ("data", "val_fraction"), ("data", "tokenizer_hash"),
        ("data", "eval_data"))  # fmt: skip
"""What a resumed run must share with the saved one besides the model: the global batch and
the data (its validation set too: `--keep-best` compares losses across the resume), or the
continued trajectory would not be the saved run's."""


ARCHITECTURE = ("n_layers", "d_model", "n_heads", "n_kv_heads", "norm", "mlp", "pos")
"""The model fields that make two models different architectures: a difference in one of
them is reported as the two models, named whole, not as the first field that differs (other
model fields, such as the MLP width, are named one by one)."""


def _architecture(config: dict[str, Any]) -> tuple:
    m = dict(
        config["model"],
        n_kv_heads=config["model"].get("n_kv_heads") or config["model"].get("n_heads"),
    )
    return tuple(m.get(k) for k in ARCHITECTURE)


def describe_model(config: dict[str, Any]) -> str:
    """`small-gpt (4 layers, d_model 128, 4 heads, 4 kv heads, layernorm, gelu, learned
    positions)` from a `Config.to_dict()`: the preset and the fields that tell models apart
    (a default kv head count shown as the head count it means)."""
    m = config["model"]
    kv = _architecture(config)[ARCHITECTURE.index("n_kv_heads")]
    fields = (
        f"{m.get('n_layers')} layers, d_model {m.get('d_model')}, {m.get('n_heads')} heads, "
        f"{kv} kv heads, {m.get('norm')}, {m.get('mlp')}, {m.get('pos')} positions"
    )
    return f"{config.get('preset') or 'a model'} ({fields})"


def check_resumable(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's trainer state, after checking that `config` (a `Config.to_dict()`)
    keeps its model, global batch and data; layout, ZeRO stage, precision, offload,
    recompute and schedule may change."""
    verify(path)
    state = read_trainer(path)
    saved = state["config"]
    if _architecture(saved) != _architecture(config):
        raise ConfigError(
            f"checkpoint {str(path)!r} holds another model: {describe_model(saved)}; this run "
            f"asks for {describe_model(config)} (a resumed run keeps the model; use --init-from "
            "or a fresh --out to train another)"
        )
    check_same_adapters_and_base(path, state, config)  # a LoRA run keeps its adapters' base
    pairs = [("model", k) for k in saved["model"] if k not in ARCHITECTURE] + list(KEPT)
    for section, key in pairs:
        was, now = saved[section].get(key), config[section].get(key)
        if was != now:
            raise ConfigError(
                f"checkpoint {str(path)!r} was saved with {section}.{key}={was!r}; this run asks "
                f"for {now!r} (a resumed run keeps the model, the global batch and the data; "
                "change only the layout, ZeRO stage, precision, offload, recompute or schedule)"
            )
    if config["train"]["steps"] <= state["step"]:
        raise ConfigError(
            f"checkpoint {str(path)!r} is at step {state['step']}; --steps "
            f"{config['train']['steps']} leaves nothing to train"
        )
    return state


def prune(out: Path, keep: int) -> None:
    """Remove all but the newest `keep` committed checkpoints (and older partial ones); the
    best one (`--keep-best`, `best.json`) is spared."""
    root = out / "checkpoints"
    done = [p for p in sorted(root.glob("step-*"), key=_step_of) if committed(p)]
    best = read_best(out)
    for path in done[:-keep] if keep > 0 else []:
        if best is None or path.name != Path(best["checkpoint"]).name:
            shutil.rmtree(path, ignore_errors=True)


BEST = "best.json"
"""`OUT/checkpoints/best.json`: the checkpoint of the best validation loss (`--keep-best`)."""


def mark_best(out: Path, step: int, val_loss: float, keep: int) -> Path:
    """Name `step`'s committed checkpoint the best (written whole or not at all), then prune
    what the marker no longer spares; returns the checkpoint's folder."""
    path = step_dir(out, step)
    tmp = out / "checkpoints" / (BEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "val_loss": val_loss, "checkpoint": str(path)}))
    tmp.replace(out / "checkpoints" / BEST)
    prune(out, keep)
    return path


def read_best(out: Path) -> dict[str, Any] | None:
    """The best checkpoint's record (step, val_loss, checkpoint), or None."""
    file = out / "checkpoints" / BEST
    return json.loads(file.read_text()) if file.is_file() else None
