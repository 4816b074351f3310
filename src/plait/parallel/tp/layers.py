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
and one backward. Layers keep their parameter names (`weight`, `bias`), so the model's
contract names the same parameters; each layer keeps its own shards' places (`weight_spec`,
`bias_spec`), which are the ones the contract declares (`apply.py` checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.models.dropout import KeyedDropout
from plait.models.lora import Linear as LoRALinear
from plait.models.lora import adapter_input
from plait.parallel.tp.mappings import (
    enter_region,
    exit_region,
    gather_from_tp,
    scatter_to_tp,
)
from plait.parallel.tp.sharding import ShardSpec, load_shard_, split_spec


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


class ColumnParallelLinear(nn.Module):
    """Output features split across tp: (.., in) -> (.., out/tp), or (.., out) if gathered.

    `enter`: apply f (or the SP all-gather) to the input here. Layers that share one input
    (q, k, v; gate and up) set it False and enter once, at their block, so the block costs
    one all-reduce backward rather than one per layer. `pad`: allow `out_features` not
    divisible by tp (the vocabulary); padding output features are zero and only the
    vocabulary-parallel loss, which masks them, may read ungathered padded outputs.
    """

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
        like: Tensor | None = None,
    ) -> None:
        super().__init__()
        rank, size = tp_coords(comm)
        like = like if like is not None else torch.empty(0)
        self.comm, self.tag = comm, tag
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.enter = gather_output, enter
        self.sequence_parallel = sequence_parallel
        what = f"out_features of a column-parallel Linear ({in_features} -> {out_features})"
        self.weight_spec = split_spec((out_features, in_features), 0, rank, size, pad, what)
        self.weight = new_shard(self.weight_spec, like)
        self.bias_spec: ShardSpec | None = None
        if bias:
            self.bias_spec = split_spec((out_features,), 0, rank, size, pad, what)
            self.bias = new_shard(self.bias_spec, like)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kw) -> ColumnParallelLinear:
        """The sharded form of `linear`; a materialized one gives its values to the shard."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            bias=linear.bias is not None,
            like=linear.weight,
            **kw,
        )
        copy_from_full(layer.weight, linear.weight, layer.weight_spec)
        if linear.bias is not None:
            copy_from_full(layer.bias, linear.bias, layer.bias_spec)
        if isinstance(linear, LoRALinear) and linear.adapted:
            layer.scaling, layer.lora_drop = linear.scaling, linear.lora_drop
            if linear.holds_a:  # replicated: every rank needs all of A x
                layer.lora_a = nn.Parameter(torch.empty_like(linear.lora_a))
                copy_from_full(layer.lora_a, linear.lora_a, None)
            layer.lora_b_spec = _split_like(layer.weight_spec, linear.lora_b.shape)
            layer.lora_b = new_shard(layer.lora_b_spec, linear.lora_b)
            copy_from_full(layer.lora_b, linear.lora_b, layer.lora_b_spec)
        return layer

    def adapter_input(self, x: Tensor, keys: Tensor | None) -> Tensor | None:
        """A dropout(x) on the whole input (models/lora.py), when this layer holds an A."""
        if "lora_a" not in self._parameters:
            return None
        return adapter_input(x, self.lora_a, self.lora_drop, keys)

    def region_input(self, x: Tensor) -> Tensor:
        """The input as this layer's matmul reads it: entered into the region when `enter`
        (the sequence all-gather under SP). The lighter loss (models/light_loss.py) calls it
        before selecting the head's target rows, which must be the same on every rank."""
        return enter_region(x, self.comm, self.sequence_parallel, self.tag) if self.enter else x

    def forward(self, x: Tensor, keys: Tensor | None = None, u: Tensor | None = None) -> Tensor:
        x = self.region_input(x)  # (b, s, in)
        y = F.linear(x, self.weight, self.bias)  # (b, s, out/tp)
        if "lora_b" in self._parameters:  # this rank's output slice of B (A x)
            u = self.adapter_input(x, keys) if u is None else u  # (b, s, r)
            y = y + self.scaling * F.linear(u, self.lora_b)
        if self.gather_output:
            y = gather_from_tp(y, self.comm, tag=self.tag).narrow(-1, 0, self.out_features)
        return y

    def extra_repr(self) -> str:
        spec = self.weight_spec
        return (
            f"in={self.in_features}, out={self.out_features} (local {spec.shape[0]}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"enter={self.enter}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """Input features split across tp: (.., in/tp) -> (.., out), summed over tp.

    Under sequence parallelism the sum is a reduce-scatter along the sequence and the
    output is this rank's (b, s/tp, out) shard. The bias is replicated; under SP each rank
    adds it to its own positions only, so its gradient is partial (the contract declares it
    so: models/declare.py; grads.py sums it).
    """

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
        like: Tensor | None = None,
    ) -> None:
        super().__init__()
        rank, size = tp_coords(comm)
        like = like if like is not None else torch.empty(0)
        self.comm, self.tag = comm, tag
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        what = f"in_features of a row-parallel Linear ({in_features} -> {out_features})"
        self.weight_spec = split_spec((out_features, in_features), 1, rank, size, False, what)
        self.weight = new_shard(self.weight_spec, like)
        if bias:
            self.bias = nn.Parameter(like.new_empty(out_features))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kw) -> RowParallelLinear:
        """The sharded form of `linear`; a materialized one gives its values to the shard."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            bias=linear.bias is not None,
            like=linear.weight,
            **kw,
        )
        copy_from_full(layer.weight, linear.weight, layer.weight_spec)
        if linear.bias is not None:
            copy_from_full(layer.bias, linear.bias, None)  # replicated
        if isinstance(linear, LoRALinear) and linear.adapted:
            layer.add_adapter(linear, comm)
        return layer

    def add_adapter(self, linear: LoRALinear, comm: Comm) -> None:
        """A split by input like the weight (its partial product is summed with the base's),
        B replicated; the dropout mask is this rank's slice of the input's."""
        self.scaling = linear.scaling
        self.lora_a_spec = _split_like(self.weight_spec, linear.lora_a.shape)
        self.lora_a = new_shard(self.lora_a_spec, linear.lora_a)
        copy_from_full(self.lora_a, linear.lora_a, self.lora_a_spec)
        self.lora_b = nn.Parameter(torch.empty_like(linear.lora_b))
        copy_from_full(self.lora_b, linear.lora_b, None)
        self.lora_drop = ShardedDropout.from_dropout(linear.lora_drop, 2, comm)

    def forward(self, x: Tensor, keys: Tensor | None = None) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.comm, tag=self.tag)  # (b, s, in/tp)
        y = F.linear(x, self.weight)  # (b, s, out), partial over tp
        lora = "lora_b" in self._parameters
        if lora:  # A's partial product rides in the same collective: r more features
            y = torch.cat((y, adapter_input(x, self.lora_a, self.lora_drop, keys)), dim=-1)
        y = exit_region(y, self.comm, self.sequence_parallel, self.tag)
        if lora:
            y, u = y.split((self.out_features, self.lora_a.shape[0]), dim=-1)
            y = y + self.scaling * F.linear(u, self.lora_b)
        return y if self.bias is None else y + self.bias  # (b, s, out) or (b, s/tp, out)

    def extra_repr(self) -> str:
        spec = self.weight_spec
        return (
            f"in={self.in_features} (local {spec.shape[1]}), out={self.out_features}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


def _split_like(base: ShardSpec, shape: tuple[int, ...]) -> ShardSpec:
    """An adapter matrix split along the dimension it shares with its base weight: B (out, r)
    by output like a column-parallel weight, A (r, in) by input like a row-parallel one."""
    return ShardSpec(
        tuple(shape),
        tuple(o if d == base.dim else 0 for d, o in enumerate(base.offsets)),
        tuple(n if d == base.dim else shape[d] for d, n in enumerate(base.local_shape)),
        base.dim,
    )


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
