"""`plait checkpoint info` and `plait checkpoint consolidate`: a checkpoint seen whole.

Both read in one process, without a process group: the checkpoint names every tensor by its
single-process name and shape, so whatever layout wrote it, the reader assembles full
tensors from the boxes (DeepSpeed users know the need as `zero_to_fp32`). Nothing is
unpickled but DCP's own metadata; plait's state is JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plait.checkpoint import store
from plait.checkpoint.base import (
    check_available,
    describe,
    relocated,
    saved_base,
    targets_text,
)
from plait.checkpoint.io import dcp_module, one_process_is_fine, saved_shapes
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.declare import is_adapter
from plait.models.hf.load import hf_source
from plait.models.init import ValueSource, canonical_name, fill_parameters, seeded
from plait.models.nf4.source import dequantized
from plait.models.transformer import Transformer
from plait.outdir import atomic_file


def _checked(path: Path) -> Path:
    """The checkpoint `path` names (itself, or a run folder's newest), verified."""
    found = store.complete(path)
    store.verify(found)
    return found


def info(path: Path) -> dict[str, Any]:
    """Step, the layout that wrote it, the model, and what the checkpoint holds."""
    path = _checked(path)
    state = store.read_trainer(path)
    cfg = state["config"]
    par = cfg["parallel"]
    shapes = saved_shapes(path)
    masters = {k: s for k, s in shapes.items() if k.startswith("master/")}
    facts = {
        "path": str(path),
        "step": state["step"],
        "layout": f"dp={par['dp']} pp={par['pp']} tp={par['tp']}",
        "zero": cfg["memory"]["zero"],
        "precision": cfg["train"]["precision"],
        "model": cfg["preset"],
        "parameters": sum(torch.Size(s).numel() for s in masters.values()),
        "tensors": len(shapes),
        "states": sorted({k.split("/", 1)[0] for k in shapes}),
        "bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
    }
    base = saved_base(state)
    if base is not None:  # the checkpoint holds the adapters; the base is named, not held
        m = cfg["model"]
        adapters = [s for k, s in masters.items() if is_adapter(k)]
        count = sum(torch.Size(s).numel() for s in adapters)
        facts["lora"] = f"rank {m['lora_rank']}, alpha {m['lora_alpha']}, targets {targets_text(m)}"
        facts["adapter_parameters"] = count
        facts["adapter_bytes"] = 4 * count  # fp32 masters; the states add 4 bytes each
        facts["base"] = describe(base).removeprefix("--init-from ")
    return facts


def read_masters(path: Path) -> dict[str, torch.Tensor]:
    """The full fp32 master weights under single-process names, whatever layout saved them."""
    path = _checked(path)
    shapes = {k: s for k, s in saved_shapes(path).items() if k.startswith("master/")}
    request = {k: torch.empty(s, dtype=torch.float32) for k, s in shapes.items()}
    with one_process_is_fine():
        dcp_module().load(request, checkpoint_id=str(path), no_dist=True)
    return {k.removeprefix("master/"): t.contiguous() for k, t in request.items()}


def read_params(path: Path, base_folder: str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of the trained model, full fp32 under single-process names: the
    masters, and for a LoRA checkpoint (which holds only its adapters) the frozen base from
    the source its trainer state records, or from `base_folder` where it moved (checked
    against its hash first)."""
    path = _checked(path)
    cfg, state = model_config(path), store.read_trainer(path)
    base = checked_base(path, state, base_folder)
    masters = read_masters(path)
    if base is None:
        return masters
    source = _base_source(base, cfg)
    with torch.device("meta"):
        shapes = {canonical_name(cfg, n): tuple(p.shape)
                  for n, p in Transformer(cfg).named_parameters()}  # fmt: skip
    values = {n: source(n, s, None) for n, s in shapes.items() if not is_adapter(n)}
    return values | masters


def checked_base(
    path: Path, state: dict[str, Any], base_folder: str | None
) -> dict[str, Any] | None:
    """A checkpoint's base (None: no adapters), found where it was recorded or at
    `base_folder` (`--init-from NEWDIR`), its hash checked; `base_folder` for a checkpoint
    without adapters is refused (it holds its whole model)."""
    base = saved_base(state)
    if base is None:
        if base_folder:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds its whole model (no LoRA adapters): "
                f"--init-from {base_folder} names no base of it; leave it out"
            )
        return None
    if base_folder:
        return relocated(path, base, base_folder)
    check_available(path, base)
    return base


def _base_source(base: dict[str, Any], cfg: ModelConfig) -> ValueSource:
    """Where a LoRA checkpoint's base comes from: its folder or its seed; a QLoRA base's
    Linear weights as its run computed with them, dequantized from NF4."""
    source = (
        seeded(cfg, base["seed"])
        if base["init_from"] is None
        else hf_source(Path(base["init_from"]), cfg)
    )
    if base.get("quantization") == "nf4":
        return dequantized(source, cfg, base["seed"], base["init_from"] or "")
    return source


def model_config(path: Path) -> ModelConfig:
    """The model config the checkpoint was trained with."""
    return ModelConfig(**store.read_trainer(_checked(path))["config"]["model"])


def load_model(path: Path, base_folder: str | None = None) -> Transformer:
    """The whole trained model in one process (CPU, fp32), from any layout's checkpoint (a
    LoRA checkpoint's base from `base_folder` where it moved)."""
    cfg = model_config(path)
    params = read_params(path, base_folder)
    model = Transformer(cfg)
    fill_parameters(model, lambda name, shape, shard: params[canonical_name(cfg, name)])
    return model


def consolidate(path: Path, out: Path) -> dict[str, Any]:
    """Write the full fp32 model (the master weights, single-process names; a LoRA
    checkpoint's base beside its adapters) to safetensors."""
    path = store.complete(path)
    tensors = read_params(path)
    with atomic_file(out) as tmp:  # never a half-written file under the name
        save_file(tensors, str(tmp), metadata={"step": str(store.read_trainer(path)["step"])})
    return {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}
