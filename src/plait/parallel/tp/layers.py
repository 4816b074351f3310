"""Column- and row-parallel Linear layers, sharded dropout, and the region-entry hook.

A Linear computes Y = X A^T + b with A of shape (out, in). Megatron splits the two Linears
of a block in conjugate ways (Shoeybi et al., 2019, section 3):

- column-parallel: A split by output features; rank r computes Y_r = X A_r^T, its slice of
  the output features. Needs the whole X (replicated, or gathered under SP).
- row-parallel: A split by input features; rank r computes X_r A_r^T from its slice of the
  input features, a partial sum of Y. Summing the partials (all-reduce, or reduce-scatter
  under SP) gives Y; the bias is added once, after the sum.

A column-parallel layer feeding a row-parallel one needs no communication in between
(the element-wise nonlinearity works on the slice), so a block costs one all-reduce forward
and one backward. Both are a `ParallelLinear`, whose parameters are the declarations of a
Linear of its style (models/declare.py), split for this rank: the same names (`weight`,
`bias`, `lora_a`, `lora_b`) and shards as the model's contract (`apply.py` hands each layer
its declarations from the split contract and checks the result).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.models.block_table import Style
from plait.models.contract import ParamDecl
from plait.models.declare import linear_params
from plait.models.dropout import KeyedDropout
from plait.models.lora import Linear as LoRALinear
from plait.models.lora import adapter_input
from plait.parallel.tp.mappings import (
    enter_region,
    exit_region,
    gather_from_tp,
    scatter_to_tp,
)
from plait.parallel.tp.sharding import ShardSpec, load_shard_


def tp_coords(comm: Comm) -> tuple[int, int]:
    """(rank, size) on the tp axis."""
    return comm.mesh.axis_rank("tp"), comm.mesh.size("tp")


def new_shard(spec: ShardSpec, like: Tensor) -> nn.Parameter:
    """An uninitialized local shard on `like`'s device and dtype (meta stays meta)."""
    return nn.Parameter(torch.empty(spec.shape, device=like.device, dtype=like.dtype))


def copy_from_full(param: nn.Parameter, source: Tensor, spec: ShardSpec | None) -> None:
    """Give a new shard its slice of an already materialized full parameter."""
    if source.is_meta:
        return
    if spec is None:
        with torch.no_grad():
            param.copy_(source)
    else:
        load_shard_(param, source, spec)


Like = Callable[[str], Tensor]
"""Parameter leaf -> a tensor whose device and dtype its new shard takes."""


class ParallelLinear(nn.Module):
    """What the column- and row-parallel Linears share: their parameters, one per declaration
    of a Linear of their style (models/declare.py `linear_params`: weight, bias, LoRA's A and
    B, each with this rank's shard or replicated), so the split of every parameter, an
    adapter's included, is the contract's and not re-derived here; and the adapter's scaling
    and dropout, taken from the Linear it replaces. Subclasses say how the input enters and
    the output leaves (`forward`), and their own options for `extra_repr` (`options`)."""

    STYLE: ClassVar[Style]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        bias: bool,
        pad: bool,
        sequence_parallel: bool,
        tag: str,
        like: Like | None,
        decls: Sequence[ParamDecl] | None,
    ) -> None:
        """`decls`: this layer's declarations on this rank (`apply.py` hands them from the
        split contract); None: a fresh Linear's (`declare`, with `bias` and `pad`).
        `like(leaf)`: a tensor whose device and dtype the leaf's shard takes (None: CPU
        fp32)."""
        super().__init__()
        if decls is None:
            decls = self.declare(in_features, out_features, comm, bias, pad)
        like = like or (lambda _: torch.empty(0))
        self.comm, self.tag, self.sequence_parallel = comm, tag, sequence_parallel
        self.out_features, self.in_features = decls[0].shape  # the weight comes first
        self.specs: dict[str, ShardSpec | None] = {}
        for decl in decls:
            self.specs[decl.leaf] = decl.shard
            src = like(decl.leaf)
            data = torch.empty(decl.local_shape, device=src.device, dtype=src.dtype)
            self.register_parameter(decl.leaf, nn.Parameter(data))
        if "bias" not in self.specs:
            self.register_parameter("bias", None)
        self.adapted, self.holds_a = "lora_b" in self.specs, "lora_a" in self.specs
        self.scaling, self.lora_drop = 0.0, None

    @classmethod
    def declare(
        cls, in_f: int, out_f: int, comm: Comm, bias: bool, pad: bool = False
    ) -> list[ParamDecl]:
        """A fresh layer's declarations, split for this rank (a layer built on its own)."""
        rank, size = tp_coords(comm)
        side = "out_features" if cls.STYLE == "column" else "in_features"
        what = f"{side} of a {cls.STYLE}-parallel Linear ({in_f} -> {out_f})"
        decls = linear_params("", (out_f, in_f), cls.STYLE, bias, padded=pad)
        return [d.split(rank, size, what) for d in decls]

    @property
    def weight_spec(self) -> ShardSpec:
        """This rank's slice of the weight (split by output or input features)."""
        spec = self.specs["weight"]
        assert spec is not None
        return spec

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, comm: Comm, decls: Sequence[ParamDecl] | None = None, **kw
    ) -> Self:
        """The sharded form of `linear` as `decls` (its declarations on this rank, from the
        split contract; default: a plain Linear's, `pad` as the constructor's); a materialized
        one gives its values."""
        pad = kw.pop("pad", False)
        if decls is None:
            bias = linear.bias is not None
            decls = cls.declare(linear.in_features, linear.out_features, comm, bias, pad)
        shape = (linear.in_features, linear.out_features)
        layer = cls(*shape, comm, decls=decls, like=linear.get_parameter, **kw)
        for leaf, spec in layer.specs.items():
            copy_from_full(layer.get_parameter(leaf), linear.get_parameter(leaf), spec)
        if layer.adapted:
            assert isinstance(linear, LoRALinear)
            layer.scaling, layer.lora_drop = linear.scaling, layer.adapter_dropout(linear, comm)
        return layer

    def adapter_dropout(self, linear: LoRALinear, comm: Comm) -> nn.Module | None:
        """The adapter's dropout on this layer's input (the whole input by default)."""
        return linear.lora_drop

    def adapter_input(self, x: Tensor, keys: Tensor | None) -> Tensor | None:
        """A dropout(x) (models/lora.py), when this layer holds an A."""
        if not self.holds_a:
            return None
        return adapter_input(x, self.lora_a, self.lora_drop, keys)

    def extra_repr(self) -> str:
        """Both widths, this rank's share of the split one, the bias and the options."""
        split = 0 if self.STYLE == "column" else 1  # the weight's dim this rank holds a slice of
        width = [f"out={self.out_features}", f"in={self.in_features}"]
        width[split] += f" (local {self.weight_spec.shape[split]})"
        options = {**self.options(), "sequence_parallel": self.sequence_parallel}
        shown = [f"{name}={value}" for name, value in options.items()]
        return ", ".join([width[1], width[0], f"bias={self.bias is not None}", *shown])

    def options(self) -> dict[str, object]:
        """The subclass's own options, as `extra_repr` shows them."""
        return {}


class ColumnParallelLinear(ParallelLinear):
    """Output features split across tp: (.., in) -> (.., out/tp), or (.., out) if gathered.

    `enter`: apply f (or the SP all-gather) to the input here. Layers that share one input
    (q, k, v; gate and up) set it False and enter once, at their block, so the block costs
    one all-reduce backward rather than one per layer. `pad`: allow `out_features` not
    divisible by tp (the vocabulary); padding output features are zero and only the
    vocabulary-parallel loss, which masks them, may read ungathered padded outputs. An
    adapter's A is replicated (every rank needs all of A x) and B split like the weight.
    """

    STYLE = "column"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        *,
        bias: bool = True,
        gather_output: bool = False,
        enter: bool = True,
        sequence_parallel: bool = False,
        pad: bool = False,
        tag: str = "tp",
        like: Like | None = None,
        decls: Sequence[ParamDecl] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, comm, bias, pad, sequence_parallel, tag,
                         like, decls)  # fmt: skip
        self.gather_output, self.enter = gather_output, enter

    def options(self) -> dict[str, object]:
        return {"gather_output": self.gather_output, "enter": self.enter}

    def region_input(self, x: Tensor) -> Tensor:
        """The input as this layer's matmul reads it: entered into the region when `enter`
        (the sequence all-gather under SP). The lighter loss (models/light_loss.py) calls it
        before selecting the head's target rows, which must be the same on every rank."""
        return enter_region(x, self.comm, self.sequence_parallel, self.tag) if self.enter else x

    def forward(self, x: Tensor, keys: Tensor | None = None, u: Tensor | None = None) -> Tensor:
        x = self.region_input(x)  # (b, s, in)
        y = F.linear(x, self.weight, self.bias)  # (b, s, out/tp)
        if self.adapted:  # this rank's output slice of B (A x)
            u = self.adapter_input(x, keys) if u is None else u  # (b, s, r)
            y = y + self.scaling * F.linear(u, self.lora_b)
        if self.gather_output:
            y = gather_from_tp(y, self.comm, tag=self.tag).narrow(-1, 0, self.out_features)
        return y


class RowParallelLinear(ParallelLinear):
    """Input features split across tp: (.., in/tp) -> (.., out), summed over tp.

    Under sequence parallelism the sum is a reduce-scatter along the sequence and the
    output is this rank's (b, s/tp, out) shard. The bias is replicated; under SP each rank
    adds it to its own positions only, so its gradient is partial (the contract declares it
    so: models/declare.py; grads.py sums it). An adapter's A is split by input like the
    weight (its partial product is summed with the base's) and B replicated.
    """

    STYLE = "row"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        tag: str = "tp",
        like: Like | None = None,
        decls: Sequence[ParamDecl] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, comm, bias, False, sequence_parallel, tag,
                         like, decls)  # fmt: skip
        self.input_is_parallel = input_is_parallel

    def adapter_dropout(self, linear: LoRALinear, comm: Comm) -> nn.Module | None:
        """The dropout mask on this rank's slice of the input (dim 2) of the whole one's."""
        assert linear.lora_drop is not None
        return ShardedDropout.from_dropout(linear.lora_drop, 2, comm)

    def forward(self, x: Tensor, keys: Tensor | None = None) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.comm, tag=self.tag)  # (b, s, in/tp)
        y = F.linear(x, self.weight)  # (b, s, out), partial over tp
        if self.adapted:  # A's partial product rides in the same collective: r more features
            y = torch.cat((y, adapter_input(x, self.lora_a, self.lora_drop, keys)), dim=-1)
        y = exit_region(y, self.comm, self.sequence_parallel, self.tag)
        if self.adapted:
            y, u = y.split((self.out_features, self.lora_a.shape[0]), dim=-1)
            y = y + self.scaling * F.linear(u, self.lora_b)
        return y if self.bias is None else y + self.bias  # (b, s, out) or (b, s/tp, out)


class ShardedDropout(KeyedDropout):
    """KeyedDropout on this rank's equal slice, along `dim`, of a tensor split over tp.

    The mask is the matching slice of the mask the whole tensor gets in one process, so
    dropout stays layout-independent: attention probabilities (b, a/tp, s, s) split by
    head (dim 1), residual and embedding outputs (b, s/tp, h) split by sequence (dim 1).
    """

    def __init__(self, p: float, site: int, dim: int, rank: int, size: int) -> None:
        super().__init__(p, site)
        if dim < 1:
            raise ValueError(f"dim {dim} must be >= 1: dim 0 is the batch")
        self.dim, self.rank, self.size = dim, rank, size

    @classmethod
    def from_dropout(cls, drop: KeyedDropout, dim: int, comm: Comm) -> ShardedDropout:
        rank, size = tp_coords(comm)
        return cls(drop.p, drop.site, dim, rank, size)

    def forward(
        self,
        x: Tensor,
        keys: Tensor | None,
        global_shape: tuple[int, ...] | None = None,
        offsets: tuple[int, ...] | None = None,
    ) -> Tensor:
        if global_shape is not None or offsets is not None:
            raise ValueError("ShardedDropout derives global_shape and offsets itself")
        glob, offs = list(x.shape[1:]), [0] * (x.dim() - 1)
        d = self.dim - 1  # per-sample dims exclude the batch
        glob[d] *= self.size
        offs[d] = self.rank * x.shape[self.dim]
        return super().forward(x, keys, tuple(glob), tuple(offs))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}, shard {self.rank}/{self.size}"


class EnterRegion:
    """Forward pre-hook on a block (attention, MLP): its input enters the tp region once.

    f (or the SP all-gather) applied to the block's first argument, shared by all of the
    block's column-parallel layers. A hook rather than a wrapper module so that the model's
    module tree and parameter names stay exactly those of the single-process model.
    """

    def __init__(self, comm: Comm, sequence_parallel: bool, tag: str = "tp") -> None:
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, tag

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        if not args:
            raise TypeError(f"{type(module).__name__} must get its input positionally under tp")
        x, *rest = args
        return (enter_region(x, self.comm, self.sequence_parallel, self.tag), *rest)

    def __repr__(self) -> str:
        return f"EnterRegion(sequence_parallel={self.sequence_parallel}, tag={self.tag!r})"
