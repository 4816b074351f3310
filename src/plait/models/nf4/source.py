"""Where an NF4 base's weights come from: quantized once, whole, from the run's first weights
(the seed or an unquantized Hugging Face folder), or read as they are from a folder saved
4-bit by transformers. Each call gives one whole weight; the engine keeps its rank's slice
(parallel/zero/nf4_base.py), so no rank holds more than one full-precision weight at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from plait.models.architecture import ModelConfig
from plait.models.declare import block_params, is_adapter
from plait.models.hf.config_json import read_config
from plait.models.hf.load import HFWeights, hf_source
from plait.models.hf.mapping import piece, pieces
from plait.models.init import ShardLike, ValueSource, init_value
from plait.models.nf4.format import NF4Source, NF4Tensor, dequantize, quantize
from plait.models.nf4.hf import folder_scheme, read_nf4


def nf4_source(cfg: ModelConfig, seed: int, init_from: str = "") -> NF4Source:
    """The NF4 weights of a run whose base starts from `init_from` (a folder; "" the seed)."""
    if not init_from:

        def seeded(name: str, shape: tuple[int, ...]) -> NF4Tensor:
            return quantize(init_value(cfg, name, shape, seed))

        return seeded
    folder = Path(init_from)
    if folder_scheme(read_config(folder), str(folder / "config.json")) == "nf4":
        weights, table = HFWeights(folder), pieces(cfg)

        def stored(name: str, shape: tuple[int, ...]) -> NF4Tensor:
            return read_nf4(weights.tensor, piece(cfg, table, name).hf_name)

        return stored
    base = hf_source(folder, cfg)

    def from_folder(name: str, shape: tuple[int, ...]) -> NF4Tensor:
        return quantize(base(name, shape, None))

    return from_folder


def dequantized(source: ValueSource, cfg: ModelConfig, seed: int, init_from: str) -> ValueSource:
    """`source`, its blocks' Linear weights replaced by their NF4 values dequantized to fp32:
    the weights a QLoRA run computed with (a checkpoint read back, exported or merged)."""
    weights = nf4_source(cfg, seed, init_from)
    leaves = [d for d in block_params(cfg) if len(d.shape) == 2 and not is_adapter(d.leaf)]
    quantized = {f"blocks.{i}.{d.leaf}": d.shape for i in range(cfg.n_layers) for d in leaves}

    def value(name: str, shape: tuple[int, ...], shard: ShardLike | None) -> Tensor:
        if name not in quantized:
            return source(name, shape, shard)
        whole = dequantize(weights(name, tuple(quantized[name])), torch.float32)
        if shard is None:
            return whole
        pairs = zip(shard.offsets, shard.local_shape, strict=True)
        return whole[tuple(slice(o, o + n) for o, n in pairs)]

    return value
