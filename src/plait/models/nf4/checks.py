"""What a QLoRA run (`--base-dtype nf4`) needs of its layout and its folder, checked before
any worker starts (config/checks.py calls `check_nf4_run`): one line naming the values each."""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.declare import block_params, is_adapter
from plait.models.nf4.format import whole_blocks
from plait.models.nf4.hf import is_nf4_folder


def check_nf4_run(base_dtype: str, tp: int, model: ModelConfig, init_from: str) -> None:
    """Each tensor-parallel rank holds whole 64-weight blocks of an NF4 base, and a folder
    saved 4-bit is read only so."""
    if base_dtype == "nf4" and tp > 1:
        check_slices(model, tp)
    if init_from and base_dtype != "nf4" and is_nf4_folder(Path(init_from)):
        raise ConfigError(
            f"--init-from {init_from} is saved 4-bit (bitsandbytes NF4): train LoRA adapters "
            "on it with --lora-rank R --base-dtype nf4"
        )


def check_slices(model: ModelConfig, tp: int) -> None:
    """Each tensor-parallel rank holds whole 64-weight NF4 blocks of every block Linear."""
    for d in block_params(model):
        base = len(d.shape) == 2 and d.split_dim is not None and not is_adapter(d.leaf)
        if base and not whole_blocks(d.shape, d.split_dim, tp):
            out_f, in_f = d.shape
            how = "output" if d.split_dim == 0 else "input"
            layer = d.leaf.removesuffix(".weight")
            raise ConfigError(
                f"--base-dtype nf4 with --tp {tp} cuts {layer} ({in_f} -> {out_f}) by "
                f"{how} features into slices that are not whole 64-weight NF4 blocks: "
                "give a --tp that divides it into multiples of 64"
            )
