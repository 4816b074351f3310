"""Write plait weights as a Hugging Face folder: config.json and sharded model.safetensors.

The folder is written under a temporary name beside `out` and renamed when complete, so a
failure never leaves something that looks finished. Shards follow the Hugging Face
convention (`model-00001-of-00002.safetensors` with `model.safetensors.index.json`); a model
that fits in one shard is a single `model.safetensors`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.hf.config_json import hf_config
from plait.models.hf.load import INDEX, WEIGHTS
from plait.models.hf.mapping import to_hf
from plait.outdir import check_out_folder, publish


def check_out(out: Path) -> None:
    """The export target: a writable folder path that does not exist yet (or is empty)."""
    check_out_folder(out)
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty folder")


def shard(tensors: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Tensors in name order, a new shard whenever the next would pass `max_bytes`."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def _write_weights(folder: Path, tensors: dict[str, Tensor], max_bytes: int) -> int:
    parts = shard(tensors, max_bytes)
    meta = {"format": "pt"}
    if len(parts) == 1:
        save_file(parts[0], str(folder / WEIGHTS), metadata=meta)
        return 1
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts, start=1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, str(folder / name), metadata=meta)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return len(parts)


def write_folder(
    cfg: ModelConfig,
    params: dict[str, Tensor],
    out: Path,
    max_shard_bytes: int = 2 * 2**30,
    tokenizer: tuple[Path, int] | None = None,
) -> dict[str, Any]:
    """Write full single-process tensors (plait names) as a Hugging Face folder at `out`;
    `tokenizer`: the run's tokenizer.json and end-of-document id, copied beside them (a
    byte-level run has none: its ids are UTF-8 bytes)."""
    check_out(out)
    hf = hf_config(cfg)
    tensors = to_hf(cfg, params)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if tokenizer is not None:
            shutil.copyfile(tokenizer[0], tmp / "tokenizer.json")
            hf["eos_token_id"] = hf["bos_token_id"] = tokenizer[1]
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        files = _write_weights(tmp, tensors, max_shard_bytes)
        publish(tmp)  # mkdtemp's 0700 and safetensors' 0600: others could not load it
        if out.exists():
            out.rmdir()  # empty (check_out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"architecture": hf["architectures"][0], "tensors": len(tensors), "files": files}
