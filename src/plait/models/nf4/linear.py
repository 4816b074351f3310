"""A Linear over an NF4 weight: dequantized per use, only the packed bytes kept for backward.

The base weight of a QLoRA Linear is frozen, so backward needs it only for the input's
gradient, dx = dy W. `NF4Linear` dequantizes W for the forward product, lets it go, and
dequantizes it again in backward from the bytes it refers to (the held `NF4Tensor`, which the
model holds anyway): no full-precision copy of a weight outlives the product that uses it,
and autograd keeps nothing for the weight (x is not kept either: W takes no gradient). The
arithmetic is bitsandbytes' `MatMul4Bit` (what PEFT's `Linear4bit` runs): forward
`linear(x, dequantize(W, x.dtype), b)`, backward `matmul(dy, dequantize(W).to(dy.dtype))`
(dequantized to the dtype W was quantized from, then cast). A layer held with a `compute`
dtype other than its input's (`--base-upcast`: activations in fp32, the NF4 products in
bf16, as PEFT's `prepare_model_for_kbit_training` leaves them) casts x to it and the product
back, as bitsandbytes' `Linear4bit` does with its `compute_dtype`.

The layers themselves are unchanged (models/lora.py, parallel/tp/layers.py call
`F.linear(x, self.weight, ...)`): `compute_over_nf4` runs a layer's forward under a
`TorchFunctionMode` (torch's public override hook) that sends the one `F.linear` whose weight
is this layer's NF4-held parameter to `NF4Linear`, and every other call on as it was. The
parameter itself keeps its name, shape and dtype with no storage, as ZeRO-3's released
parameters do: its values live in the NF4 bytes only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from plait.models.nf4.format import NF4Tensor, dequantize


@dataclass
class HeldNF4:
    """The NF4 weight one layer computes with (replaced, not mutated, when it moves)."""

    weight: NF4Tensor
    compute: torch.dtype | None = None  # the products' dtype; None: the input's
    meter: Callable[[Tensor | None], None] | None = None  # told of the dequantized weight


class NF4Linear(torch.autograd.Function):
    """y = x W^T + b, W dequantized from `held` in the forward and again in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, held: HeldNF4) -> Tensor:
        ctx.held = held  # the packed bytes, by reference: nothing copied, nothing saved
        w = dequantize(held.weight, x.dtype)  # (out, in), for this product only
        return _metered(held, w, lambda: F.linear(x, w, bias))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = dequantize(ctx.held.weight).to(grad.dtype)  # as MatMul4Bit: its dtype, then dy's
        return _metered(ctx.held, w, lambda: torch.matmul(grad, w)), None, None


def _metered(held: HeldNF4, weight: Tensor, product: Callable[[], Tensor]) -> Tensor:
    """`product()`, with `held.meter` told of the dequantized `weight` while it runs (the
    memory tracker counts it: a transient, one weight at a time)."""
    if held.meter is None:
        return product()
    held.meter(weight)
    try:
        return product()
    finally:
        held.meter(None)


class _Route(TorchFunctionMode):
    """Inside a layer's forward: `F.linear(x, weight, bias)` on this layer's NF4-held weight
    becomes `NF4Linear`; any other call (the adapter's products) runs unchanged."""

    def __init__(self, weight: Tensor, held: HeldNF4) -> None:
        super().__init__()
        self.weight, self.held = weight, held

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) > 1 and args[1] is self.weight:
            x, bias = args[0], args[2] if len(args) > 2 else kwargs.get("bias")
            compute = self.held.compute
            if compute is None or compute == x.dtype:
                return NF4Linear.apply(x, bias, self.held)
            bias = None if bias is None else bias.to(compute)
            return NF4Linear.apply(x.to(compute), bias, self.held).to(x.dtype)
        return func(*args, **kwargs)


def compute_over_nf4(module: nn.Module, held: HeldNF4) -> None:
    """Make `module` (a Linear: plain, LoRA or tensor-parallel) compute with `held` where its
    forward multiplies by `module.weight` (an instance attribute, this module only)."""
    inner = module.forward
    weight = module.get_parameter("weight")

    def forward(*args, **kwargs):
        with _Route(weight, held):
            return inner(*args, **kwargs)

    module.forward = forward


@torch.no_grad()
def release_storage(param: nn.Parameter) -> None:
    """`param` keeps its name, shape and dtype with zero bytes of storage (its values live
    in NF4 now), as a released ZeRO-3 parameter does; nothing may read it."""
    empty = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    empty.untyped_storage().resize_(0)
    param.data = empty
