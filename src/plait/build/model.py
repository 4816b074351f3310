"""A rank's model: where its first weights come from, and how it is built and parallelized.

Built on the meta device first, so a model too large for one device is never allocated
whole: the parallelization (tensor-parallel sharding, pipeline stage split) shrinks it before
any memory is touched, and each parameter (or shard) is then filled from its (seed, name)
generator or its slice of a folder, so the values do not depend on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from plait.config import Config
from plait.models.architecture import ModelConfig
from plait.models.contract import contract_of
from plait.models.hf.load import hf_source
from plait.models.hf.peft import adapter_source
from plait.models.init import ValueSource, fill_parameters, seeded, with_adapters
from plait.models.nf4.format import NF4Source
from plait.models.nf4.source import nf4_source
from plait.models.transformer import Transformer
from plait.torch_private import replace_tensors


@dataclass(frozen=True)
class FirstWeights:
    """Where a run's first weights come from: `values` for every parameter, and `nf4` for
    the blocks' Linear weights when the base is held in NF4 (`--base-dtype nf4`), else None.
    `streamed`: the model is never materialized in full precision; the engine fills its
    own shards from `values` (ZeRO stage 3) and holds the NF4 weights one at a time."""

    values: ValueSource
    nf4: NF4Source | None
    streamed: bool


def first_weights(cfg: Config) -> FirstWeights:
    """`--init-from`'s folder, else the seed; a LoRA run's adapters from `--adapter`'s PEFT
    folder, else the seed; an NF4 base quantized from the same source (or read as stored
    when the folder holds NF4 already: models/nf4/source.py)."""
    par = cfg.parallel
    nf4 = cfg.lora.base_dtype == "nf4"
    source = nf4_source(cfg.model, cfg.train.seed, cfg.checkpoint.init_from) if nf4 else None
    streamed = (cfg.memory.zero == 3 or nf4) and not par.two_bw
    return FirstWeights(_values(cfg), source, streamed)


def _values(cfg: Config) -> ValueSource:
    """Every parameter's first value: from the folder and the PEFT adapter, or seeded."""
    if cfg.checkpoint.init_from:
        base = hf_source(Path(cfg.checkpoint.init_from), cfg.model)
        if cfg.model.lora is None:
            return base
        folder = cfg.lora.adapter
        adapters = adapter_source(Path(folder), cfg.model) if folder else None
        return with_adapters(base, cfg.model, cfg.train.seed, adapters)
    return seeded(cfg.model, cfg.train.seed)


def build_model(
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    parallelize: Callable[[Transformer], None] | None = None,
    materialize: bool = True,
    source: ValueSource | None = None,
) -> Transformer:
    """Build on the meta device, parallelize, then materialize on `device` and initialize.

    `parallelize` (tensor-parallel sharding, pipeline stage split) runs on the meta model.
    With `materialize=False` the parameters are moved to `device` holding zero bytes and
    left uninitialized: ZeRO stage 3 fills its shards from `initial_values` and binds the
    parameters to its own buffers. `source` replaces the seeded values (a Hugging Face
    folder: `first_weights`)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if parallelize is not None:
        parallelize(model)
    if materialize:
        model.to_empty(device=device)
        fill_parameters(model, source or seeded(cfg, seed))
    else:
        _to_device_without_storage(model, device)
    return model


def _to_device_without_storage(model: nn.Module, device: torch.device) -> None:
    """Every parameter on `device` with zero-byte storage, one allocated at a time.

    This is `Module.to_empty` (which goes through the same walk) except that each new
    tensor gives its memory back at once, so the model never exists whole."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t, device=device)
        out.untyped_storage().resize_(0)
        return out

    replace_tensors(model, empty)  # torch's private Module._apply: torch_private says why
    contract_of(model).tie(model)  # replace_tensors untied them
