"""Precision policy (fp32, bf16, fp16) and the dynamic loss scaler fp16 needs.

Mixed precision after Micikevicius et al. (Mixed Precision Training, 2018): the model
computes with 16-bit copies of the parameters, while the optimizer updates fp32 *master*
weights, because a 16-bit weight cannot absorb updates smaller than its rounding step
(lr x update ~ 1e-4 of the weight vanishes in bf16's 8-bit mantissa).

- fp32: parameters are the master weights; nothing is converted.
- bf16: same exponent range as fp32, so gradients never overflow; no loss scaling.
- fp16: 5 exponent bits. Small gradients underflow to zero unless the loss is multiplied
  by a large scale before backward (and the gradients divided by it before the step);
  too large a scale overflows to inf. The dynamic scaler finds the largest safe scale:
  it backs off (and the step is skipped) on any inf/nan and grows again after a window
  of clean steps.

The gradient *reduction* dtype is a separate choice: reducing 16-bit gradients halves the
communication and the gradient memory (the ZeRO paper's 2Ψ), reducing in fp32 avoids
rounding in the sum of many ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plait.errors import ConfigError
from plait.torch_private import parameters_as

PRECISIONS = ("fp32", "bf16", "fp16")
BASE_DTYPES = ("auto", *PRECISIONS, "nf4")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleError(FloatingPointError):
    """fp16 gradients overflow even at the minimum loss scale: training cannot go on."""


@dataclass(frozen=True)
class Precision:
    """Which dtypes the parameters, the gradient reduction and the master weights use."""

    name: str
    param_dtype: torch.dtype  # what the model computes with
    reduce_dtype: torch.dtype  # gradient buffers and their collectives
    base_products: torch.dtype | None = None  # an NF4 base's products, when not param_dtype

    @property
    def needs_master(self) -> bool:
        """A separate fp32 copy exists only when the parameters are not fp32 themselves."""
        return self.param_dtype != torch.float32

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"


def parse_precision(name: str, reduce_dtype: str | None = None, upcast: bool = False) -> Precision:
    """Precision from its CLI name; `reduce_dtype` (fp32/bf16/fp16) defaults to the compute dtype.

    An fp16 reduction of bf16 gradients (or the reverse) would convert between two 16-bit
    formats for nothing but rounding, so only the compute dtype or fp32 are accepted.

    `upcast` (`--base-upcast`, QLoRA as PEFT's `prepare_model_for_kbit_training` runs it):
    the model computes and reduces in fp32, only an NF4 base's products in `name`'s dtype
    (`base_products`); fp16's loss scaler stays, those products' gradients being fp16.
    """
    if name not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
    if upcast:
        check_upcast("nf4", name, reduce_dtype)
        return Precision(name, torch.float32, torch.float32, _DTYPES[name])
    param = _DTYPES[name]
    reduce = param if reduce_dtype is None else _DTYPES.get(reduce_dtype)
    if reduce not in (param, torch.float32):
        raise ConfigError(
            f"gradient reduction dtype for precision {name} must be {name} or fp32; "
            f"got {reduce_dtype!r}"
        )
    return Precision(name, param, reduce)


def check_base_dtype(name: str) -> None:
    """The one rule for `--base-dtype`'s values (the run, the estimator and the planner)."""
    if name not in BASE_DTYPES:
        raise ConfigError(f"--base-dtype must be one of {', '.join(BASE_DTYPES)}; got {name!r}")


def check_upcast(base_dtype: str, precision: str, reduce_dtype: str | None) -> None:
    """`--base-upcast` holds an NF4 base's unquantized weights and the activations in fp32
    beside 16-bit NF4 products: it needs both, and reduces fp32 gradients in fp32."""
    if base_dtype != "nf4" or precision == "fp32":
        raise ConfigError(
            f"--base-upcast computes in fp32 beside an NF4 base's 16-bit products: it needs "
            f"--base-dtype nf4 and --precision bf16 or fp16 (got --base-dtype {base_dtype}, "
            f"--precision {precision})"
        )
    if reduce_dtype not in (None, "fp32"):
        raise ConfigError(
            f"--base-upcast's gradients are fp32 and reduce in fp32; got --reduce-dtype "
            f"{reduce_dtype}"
        )


def parse_base_dtype(name: str, precision: str, lora: bool) -> torch.dtype:
    """The dtype a LoRA run holds its frozen base in (`--base-dtype`): `auto` is the
    precision's parameter dtype; an explicit one only means something beside adapters,
    because without LoRA every parameter trains and is held in the precision's dtype.
    `nf4` holds the blocks' Linear weights in NF4 (parallel/zero/nf4_base.py) and the rest of
    the base in the precision's dtype, which this returns."""
    check_base_dtype(name)
    if name == "nf4" and not lora:
        raise ConfigError(
            "--base-dtype nf4 quantizes a frozen base to 4 bits (QLoRA), and only LoRA's "
            "adapters train over it: give --lora-rank R (a run without LoRA trains every weight)"
        )
    if name != "auto" and not lora:
        raise ConfigError(
            f"--base-dtype {name} is for a LoRA run's frozen base; this run has no "
            "--lora-rank (every parameter trains in the precision's dtype)"
        )
    return _DTYPES[precision if name in ("auto", "nf4") else name]


def compute_frozen_in(model: nn.Module, frozen: Sequence[nn.Parameter], dtype: torch.dtype) -> int:
    """Make every module that owns one of `frozen` (held in another dtype than `dtype`) use
    a copy cast to `dtype` during its forward, so the model computes in one dtype whatever
    the base is held in: activations start in `dtype` at the embedding, and every frozen
    weight meets them in it (as QLoRA dequantizes its base per use; the copy is transient,
    saved by autograd only where backward needs it). Returns the number of modules wrapped.

    Trainable parameters are the engine's compute-dtype copies already; a frozen one held
    in `dtype` is used as it is."""
    ids = {id(p) for p in frozen if p.dtype != dtype}
    wrapped = 0
    for module in model.modules():
        names = [n for n, p in module.named_parameters(recurse=False) if id(p) in ids]
        if names:
            _cast_at_use(module, names, dtype)
            wrapped += 1
    return wrapped


def _cast_at_use(module: nn.Module, names: list[str], dtype: torch.dtype) -> None:
    """Route `module`'s forward through one that sees `names` cast to `dtype` (instance
    attribute, as activation recomputation wraps a forward: this module only)."""
    inner = module.forward

    def forward(*args, **kwargs):
        cast = {n: module.get_parameter(n).detach().to(dtype) for n in names}
        with parameters_as(module, cast):
            return inner(*args, **kwargs)

    module.forward = forward


@dataclass
class DynamicLossScaler:
    """Multiply the loss by `scale`; halve it on overflow, double it after `window` clean steps.

    The decision must be the same on every rank (a rank that steps while another skips
    diverges forever), so `update` takes the overflow flag *after* it was agreed on by an
    all-reduce over all ranks (`ZeroEngine` does that). Defaults follow torch's GradScaler.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    window: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError(
                f"loss scaler needs growth_factor > 1 and 0 < backoff_factor < 1; got "
                f"{self.growth_factor} and {self.backoff_factor}"
            )
        if self.window < 1 or not 0.0 < self.min_scale <= self.scale:
            raise ConfigError(
                f"loss scaler needs window >= 1 and 0 < min_scale <= scale; got window "
                f"{self.window}, min_scale {self.min_scale}, scale {self.scale}"
            )

    def update(self, found_inf: bool) -> bool:
        """Record one step's (agreed) overflow flag; returns True if the step must be skipped."""
        if not found_inf:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= self.growth_factor
                self.clean_steps = 0
            return False
        if self.scale <= self.min_scale:
            raise LossScaleError(
                f"fp16 gradients are inf/nan even at the minimum loss scale {self.min_scale:g} "
                f"({self.skipped_steps} steps skipped before this one): the model has diverged "
                "or its gradients exceed fp16's range; lower the learning rate or use bf16"
            )
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        self.clean_steps = 0
        self.skipped_steps += 1
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped"])


def has_inf_or_nan(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A float32 0/1 flag, kept on the device (no host sync) so it can be all-reduced as is."""
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        if t.numel():
            flag = torch.maximum(flag, (~torch.isfinite(t)).any().to(device, torch.float32))
    return flag
