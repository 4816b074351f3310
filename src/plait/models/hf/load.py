"""Read a Hugging Face folder's weights into plait, each rank only the slices it holds.

`HFWeights` indexes the folder's safetensors files (one `model.safetensors` or the shards
named by `model.safetensors.index.json`) and reads regions with `safe_open(...).get_slice`,
so a tensor-parallel rank reads its rows or columns, a pipeline stage reads its blocks, and
ZeRO-3 reads one flat group at a time. `hf_source` is a `ValueSource`: the same path a seeded
initialization takes (`fill_parameters`, ZeRO-3's `initial_value`) fills the model from it,
which is why every layout works unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.hf.config_json import GPT2, family, from_hf_config, read_config
from plait.models.hf.mapping import Piece, piece, pieces, to_hf
from plait.models.init import ShardLike, ValueSource, padded
from plait.models.nf4.hf import dequantizing, folder_scheme, quantized_shape
from plait.models.transformer import Transformer

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it."""
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{str(folder / INDEX)!r} is not a readable index: {e}") from e
        files = {name: folder / file for name, file in index.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ConfigError(f"{str(folder / INDEX)!r} names {file.name!r}, which is missing")
        return files
    if not (folder / WEIGHTS).is_file():
        raise ConfigError(f"{str(folder)!r} has neither {WEIGHTS} nor {INDEX}")
    return {name: folder / WEIGHTS for name in _open(folder / WEIGHTS).keys()}  # noqa: SIM118


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{str(file)!r} is not a readable safetensors file: {e}") from e


class HFWeights:
    """The tensors of a Hugging Face model folder, by name, read by region."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = _weight_map(folder)
        self._handles: dict[Path, Any] = {}  # file -> open safetensors handle

    def _name(self, name: str) -> str:
        """`name`, or its form without the model prefix (GPT-2 as first released)."""
        if name in self.files:
            return name
        bare = name.split(".", 1)[1]
        if bare in self.files:
            return bare
        raise ConfigError(f"{str(self.folder)!r} has no tensor {name!r}")

    def _slice(self, name: str) -> Any:
        file = self.files[self._name(name)]
        if file not in self._handles:
            self._handles[file] = _open(file)
        return self._handles[file].get_slice(self._name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, region: tuple[slice, ...]) -> Tensor:
        """Only `region` of tensor `name` is read from disk."""
        return self._slice(name)[region]

    def tensor(self, name: str) -> Tensor:
        """The whole tensor `name` (a 4-bit weight's codes or constants: models/nf4/hf.py)."""
        return self._slice(name)[:]

    def check(self, cfg: ModelConfig) -> None:
        """Every tensor plait needs is there with its shape (headers only, no data read)."""
        with torch.device("meta"):
            params = dict(Transformer(cfg).named_parameters())
        for name, t in to_hf(cfg, params).items():
            shape = quantized_shape(self.files, self.tensor, name) or self.shape(name)
            if shape != tuple(t.shape):
                raise ConfigError(
                    f"{str(self.folder)!r}: tensor {name!r} has shape {list(shape)}, "
                    f"config.json implies {list(t.shape)}"
                )


def hf_source(folder: Path, cfg: ModelConfig) -> ValueSource:
    """A ValueSource reading each parameter (or shard) from the folder, in fp32 (a weight
    stored 4-bit dequantized: models/nf4/hf.py)."""
    weights = HFWeights(folder)
    return region_source(
        cfg, pieces(cfg), dequantizing(weights.files, weights.tensor, weights.read)
    )


def region_source(
    cfg: ModelConfig, table: dict[str, Piece], read: Callable[[str, tuple[slice, ...]], Tensor]
) -> ValueSource:
    """A ValueSource over Hugging Face tensors: each parameter (or shard) is its `Piece`'s
    region of the tensor, `read(hf_name, region)` reading no more than that region."""

    def value(name: str, shape: tuple[int, ...], shard: ShardLike | None) -> Tensor:
        p = piece(cfg, table, name)
        local = shard.local_shape if shard is not None else shape
        offsets = shard.offsets if shard is not None else (0,) * len(shape)
        if 0 in local:  # rows that are all padding: nothing to read
            return torch.zeros(shape)
        region = tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))
        real = p.to_plait(read(p.hf_name, p.hf_region(region))).float()
        return padded(shape, shard, real) if shard is not None else real.contiguous()

    return value


def load_config(folder: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder, its weights checked against it (headers)."""
    hf, where = read_config(folder), str(folder / "config.json")
    cfg = from_hf_config(hf, where)
    if folder_scheme(hf, where) and family(cfg) == GPT2:  # GPT-2's q, k, v share one Conv1D
        raise ConfigError(f"{where}: plait reads 4-bit folders of Llama models only")
    HFWeights(folder).check(cfg)
    return cfg
