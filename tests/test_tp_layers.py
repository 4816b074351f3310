"""Tensor-parallel building blocks: f/g primitives, column/row Linear, vocabulary parallelism.

Multi-rank checks run in one 4-rank gloo world: tp=4 (Layout(tp=4)) and tp=2 (Layout(dp=2,
tp=2), two independent tp groups). Primitives are checked for exact values on integer
inputs; layers against their single-process torch counterparts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.comm import Comm
from plait.composition import check_tensor_parallel
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.models.dropout import KeyedDropout
from plait.models.loss import IGNORE
from plait.models.presets import get_preset
from plait.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, ShardedDropout
from plait.parallel.tp.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from plait.parallel.tp.sharding import full_tensor, split_spec
from plait.parallel.tp.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, gather_logits
from plait.topology import Layout

RTOL, ATOL = 1e-5, 1e-5


def _comm(tp: int) -> Comm:
    world = torch.distributed.get_world_size()
    return Comm(build_mesh(Layout(dp=world // tp, tp=tp), torch.device("cpu")))


def _ints(*shape: int, start: int = 0) -> torch.Tensor:
    """Integer values in a float tensor: sums and copies are exact."""
    return torch.arange(start, start + math.prod(shape), dtype=torch.float32).view(shape)


def _calls(comm: Comm, op: str) -> int:
    return comm.stats.total(op=op, axis="tp")[0]


# ---------------------------------------------------------------- primitives
def _f_and_g(comm: Comm, r: int, n: int) -> None:
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward."""
    x = _ints(2, 3, start=100 * r).requires_grad_()
    y = copy_to_tp(x, comm)
    assert torch.equal(y, x) and _calls(comm, "all_reduce") == 0
    y.backward(_ints(2, 3, start=10 * r))
    expected = sum(_ints(2, 3, start=10 * k) for k in range(n))
    assert torch.equal(x.grad, expected) and _calls(comm, "all_reduce") == 1

    x = _ints(2, 3, start=100 * r).requires_grad_()
    y = reduce_from_tp(x, comm)
    assert torch.equal(y, sum(_ints(2, 3, start=100 * k) for k in range(n)))
    assert torch.equal(x, _ints(2, 3, start=100 * r))  # the input is not reduced in place
    y.backward(_ints(2, 3, start=7 * r))
    assert torch.equal(x.grad, _ints(2, 3, start=7 * r)) and _calls(comm, "all_reduce") == 2


def _last_dim(comm: Comm, r: int, n: int) -> None:
    """gather-from-region and scatter-to-region along the last dim."""
    x = _ints(2, 3, start=100 * r).requires_grad_()
    y = gather_from_tp(x, comm)
    assert torch.equal(y, torch.cat([_ints(2, 3, start=100 * k) for k in range(n)], dim=-1))
    y.backward(_ints(2, 3 * n))
    assert torch.equal(x.grad, _ints(2, 3 * n)[:, 3 * r : 3 * r + 3])

    full = _ints(2, 3 * n).requires_grad_()
    y = scatter_to_tp(full, comm)
    assert torch.equal(y, _ints(2, 3 * n)[:, 3 * r : 3 * r + 3])
    y.backward(_ints(2, 3, start=10 * r))
    assert torch.equal(full.grad, torch.cat([_ints(2, 3, start=10 * k) for k in range(n)], -1))
    assert _calls(comm, "all_gather") == 2


def _sequence(comm: Comm, r: int, n: int) -> None:
    """Sequence all-gather (reduce-scatter backward) and reduce-scatter (all-gather backward)."""
    shard = _ints(2, 2, 3, start=100 * r).requires_grad_()  # (b, s/n, h)
    y = gather_from_sequence(shard, comm)  # (b, s, h)
    assert torch.equal(y, torch.cat([_ints(2, 2, 3, start=100 * k) for k in range(n)], dim=1))
    y.backward(_ints(2, 2 * n, 3, start=r))
    total = sum(_ints(2, 2 * n, 3, start=k) for k in range(n))
    assert torch.equal(shard.grad, total[:, 2 * r : 2 * r + 2])

    part = _ints(2, 2 * n, 3, start=10 * r).requires_grad_()  # (b, s, h) partial sums
    y = reduce_scatter_to_sequence(part, comm)
    total = sum(_ints(2, 2 * n, 3, start=10 * k) for k in range(n))
    assert torch.equal(y, total[:, 2 * r : 2 * r + 2])
    y.backward(_ints(2, 2, 3, start=1000 * r))
    gathered = torch.cat([_ints(2, 2, 3, start=1000 * k) for k in range(n)], dim=1)
    assert torch.equal(part.grad, gathered)
    assert _calls(comm, "all_gather") == 2 and _calls(comm, "reduce_scatter") == 2
    _, elements, nbytes = comm.stats.total(op="reduce_scatter", tag="tp")
    assert (elements, nbytes) == (2 * 2 * 2 * n * 3, 4 * 2 * 2 * 2 * n * 3)  # full buffer


def _primitives(tp: int) -> None:
    comm = _comm(tp)
    r, n = comm.mesh.axis_rank("tp"), tp
    for check in (_f_and_g, _last_dim, _sequence):
        comm.stats.begin_step(0)
        check(comm, r, n)


@pytest.mark.parametrize("tp", [2, 4])
def test_primitives_exact_forward_and_backward(world4, tp):
    world4.run(_primitives, tp)


# ---------------------------------------------------------------- Linear layers
def _reference(in_f: int, out_f: int, x_shape: tuple[int, ...]):
    """nn.Linear, input and upstream gradient, identical on every rank (seeded)."""
    gen = torch.Generator().manual_seed(in_f * 100 + out_f)
    lin = nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
        lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    x = torch.randn(x_shape, generator=gen)
    grad = torch.randn((*x_shape[:-1], out_f), generator=gen)
    xr = x.clone().requires_grad_()
    lin(xr).backward(grad)
    return lin, x, grad, xr.grad


def _close(actual, expected, what: str) -> None:
    """rtol 1e-5, with an absolute floor of 1e-5 of the tensor's scale for near-zero entries
    (summation order differs between the sharded and the whole computation)."""
    atol = ATOL * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _column(comm: Comm, r: int, n: int) -> None:
    lin, x, grad, x_grad = _reference(8, 12, (2, 4, 8))
    rows = slice(12 // n * r, 12 // n * (r + 1))
    for gather in (True, False):
        col = ColumnParallelLinear.from_linear(lin, comm, gather_output=gather)
        xi = x.clone().requires_grad_()
        y = col(xi)
        _close(y, lin(x) if gather else lin(x)[..., rows], f"column out gather={gather}")
        y.backward(grad if gather else grad[..., rows])
        _close(xi.grad, x_grad, "column input grad")  # f summed the column contributions
        _close(col.weight.grad, lin.weight.grad[rows], "column weight grad shard")
        _close(col.bias.grad, lin.bias.grad[rows], "column bias grad shard")
        spec = col.weight_spec
        assert spec.global_shape == (12, 8) and spec.offsets == (rows.start, 0)
        assert torch.equal(full_tensor(col.weight, spec, comm), lin.weight.detach())


def _row(comm: Comm, r: int, n: int) -> None:
    lin, x, grad, x_grad = _reference(12, 8, (2, 4, 12))
    cols = slice(12 // n * r, 12 // n * (r + 1))
    for parallel_input in (True, False):
        row = RowParallelLinear.from_linear(lin, comm, input_is_parallel=parallel_input)
        xi = (x[..., cols] if parallel_input else x).clone().requires_grad_()
        y = row(xi)
        _close(y, lin(x), f"row out parallel_input={parallel_input}")
        y.backward(grad)
        _close(xi.grad, x_grad[..., cols] if parallel_input else x_grad, "row input grad")
        _close(row.weight.grad, lin.weight.grad[:, cols], "row weight grad shard")
        _close(row.bias.grad, lin.bias.grad, "row bias grad (replicated, complete)")
        assert row.weight_spec.offsets == (0, cols.start)


def _mlp_sequence_parallel(comm: Comm, r: int, n: int) -> None:
    """column (SP all-gather in) -> GELU -> row (SP reduce-scatter out) on sequence shards."""
    fc1, x, _, _ = _reference(8, 16, (2, 4 * n, 8))
    fc2, _, grad, _ = _reference(16, 8, (2, 4 * n, 16))
    fc1.zero_grad(), fc2.zero_grad()
    xr = x.clone().requires_grad_()
    ref = fc2(F.gelu(fc1(xr)))
    ref.backward(grad)
    col = ColumnParallelLinear.from_linear(fc1, comm, sequence_parallel=True)
    row = RowParallelLinear.from_linear(fc2, comm, sequence_parallel=True)
    seq, hid = slice(4 * r, 4 * r + 4), slice(16 // n * r, 16 // n * (r + 1))
    xs = x[:, seq].clone().requires_grad_()  # (b, s/tp, h)
    y = row(F.gelu(col(xs)))  # (b, s/tp, h)
    _close(y, ref[:, seq], "SP MLP output shard")
    y.backward(grad[:, seq])
    _close(xs.grad, xr.grad[:, seq], "SP input grad shard")
    _close(col.weight.grad, fc1.weight.grad[hid], "SP fc1 weight shard")
    _close(row.weight.grad, fc2.weight.grad[:, hid], "SP fc2 weight shard")
    partial = row.bias.grad.clone()  # this rank's positions only: summed over tp, complete
    comm.all_reduce(partial, "tp")
    _close(partial, fc2.bias.grad, "SP row bias grad summed over tp")


def _linears(tp: int) -> None:
    comm = _comm(tp)
    r = comm.mesh.axis_rank("tp")
    for check in (_column, _row, _mlp_sequence_parallel):
        check(comm, r, tp)
    col, row = ColumnParallelLinear(8, 12, comm), RowParallelLinear(12, 8, comm, bias=False)
    local = f"(local {12 // tp})"  # the split width's share, named on its side
    assert col.extra_repr() == (f"in=8, out=12 {local}, bias=True, gather_output=False, "
                                "enter=True, sequence_parallel=False")  # fmt: skip
    assert row.extra_repr() == f"in=12 {local}, out=8, bias=False, sequence_parallel=False"
    with pytest.raises(ConfigError, match=r"\(8 -> 10\)=10 is not divisible by tp=4"):
        ColumnParallelLinear(8, 10, _comm(4))


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_layers_match_nn_linear(world4, tp):
    world4.run(_linears, tp)


# ---------------------------------------------------------------- vocabulary parallelism
def _cross_entropy(comm: Comm, vocab: int) -> None:
    n = comm.mesh.size("tp")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, 5, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (2, 5), generator=gen)
    targets[0, 0] = vocab - 1  # the last real column, next to the padding
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    ref.backward()
    loss_fn = VocabParallelCrossEntropy(vocab, comm)
    spec = loss_fn.spec
    padded = torch.cat([logits, torch.full((2, 5, spec.shape[0] * n - vocab), 7.0)], dim=-1)
    mine = padded[..., spec.offsets[0] : spec.offsets[0] + spec.shape[0]]  # padding: junk 7s
    mine = mine.clone().requires_grad_()
    comm.stats.begin_step(0)
    loss = loss_fn(mine, targets)
    assert comm.stats.total(tag="tp-loss")[:2] == (2, 3 * 10)  # max (n,), sums (2, n)
    torch.testing.assert_close(loss, ref, rtol=RTOL, atol=0)
    loss.backward()
    real = spec.local_shape[0]
    _close(mine.grad[..., :real], full.grad[..., spec.region()[0]], f"CE grad V={vocab}")
    assert not mine.grad[..., real:].any(), "padding columns got gradient"


def _cross_entropy_ignored(comm: Comm, vocab: int) -> None:
    """IGNORE targets (prompt tokens, pads): the same summed loss / denom, the mean over the
    counted ones, and no gradient for an ignored token's logits, as one process computes."""
    n = comm.mesh.size("tp")
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(3, 6, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (3, 6), generator=gen)
    targets[0, :4] = IGNORE
    targets[2] = IGNORE  # a row with no target at all
    loss_fn = VocabParallelCrossEntropy(vocab, comm)
    spec = loss_fn.spec
    padded = torch.cat([logits, torch.full((3, 6, spec.shape[0] * n - vocab), 7.0)], dim=-1)
    for denom in (None, 5.5):
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                              reduction="sum" if denom else "mean")  # fmt: skip
        ref = ref / denom if denom else ref
        ref.backward()
        mine = padded[..., spec.offsets[0] : spec.offsets[0] + spec.shape[0]].clone()
        mine.requires_grad_()
        loss = loss_fn(mine, targets, denom)
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=0)
        loss.backward()
        real = spec.local_shape[0]
        _close(mine.grad[..., :real], full.grad[..., spec.region()[0]], f"CE ignore V={vocab}")
        assert not mine.grad[targets == IGNORE].any(), "an ignored token's logits got gradient"
    none = loss_fn(padded[..., spec.offsets[0] : spec.offsets[0] + spec.shape[0]],
                   torch.full((3, 6), IGNORE))  # fmt: skip
    assert none.item() == 0.0, "no target at all: loss 0, not NaN"


def _embedding(comm: Comm, vocab: int, sequence_parallel: bool) -> None:
    r, n = comm.mesh.axis_rank("tp"), comm.mesh.size("tp")
    gen = torch.Generator().manual_seed(vocab)
    ref = nn.Embedding(vocab, 6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen))
    tokens = torch.randint(0, vocab, (2, 2 * n), generator=gen)
    tokens[0, 0] = vocab - 1
    grad = torch.randn(2, 2 * n, 6, generator=gen)
    ref(tokens).backward(grad)
    emb = VocabParallelEmbedding.from_embedding(ref, comm, sequence_parallel=sequence_parallel)
    spec = emb.weight_spec
    seq = slice(2 * r, 2 * r + 2) if sequence_parallel else slice(None)
    out = emb(tokens)
    assert torch.equal(out, ref(tokens)[:, seq])  # one real term per element: exact
    out.backward(grad[:, seq])
    _close(spec.unpadded(emb.weight.grad), ref.weight.grad[spec.region()], "embedding grad")
    assert not emb.weight.grad[spec.local_shape[0] :].any()
    assert not emb.weight[spec.local_shape[0] :].any(), "padding rows must be zero"
    assert torch.equal(full_tensor(emb.weight, spec, comm), ref.weight.detach())


def _vocab(tp: int) -> None:
    comm = _comm(tp)
    for vocab in (256, 250, 3):  # 3 < tp=4: a rank with no real column at all
        _cross_entropy(comm, vocab)
        _cross_entropy_ignored(comm, vocab)
        for sp in (False, True):
            _embedding(comm, vocab, sp)
    logits = torch.randn(2, 3, 250, generator=torch.Generator().manual_seed(0))
    spec = split_spec((250,), 0, comm.mesh.axis_rank("tp"), tp, pad=True)
    mine = torch.zeros(2, 3, spec.shape[0])
    mine[..., : spec.local_shape[0]] = logits[..., spec.region()[0]]
    assert torch.equal(gather_logits(mine, comm, 250), logits)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy(world4, tp):
    world4.run(_vocab, tp)


# ---------------------------------------------------------------- pure checks
def test_split_spec_pads_and_places_shards() -> None:
    specs = [split_spec((250, 8), 0, r, 4, pad=True) for r in range(4)]
    assert [s.offsets for s in specs] == [(0, 0), (63, 0), (126, 0), (189, 0)]
    assert [s.local_shape[0] for s in specs] == [63, 63, 63, 61]
    assert [s.padding for s in specs] == [0, 0, 0, 2]
    assert all(s.shape == (63, 8) for s in specs)
    tiny = [split_spec((3,), 0, r, 4, pad=True) for r in range(4)]
    assert [(s.offsets[0], s.local_shape[0], s.padding) for s in tiny] == [
        (0, 1, 0),
        (1, 1, 0),
        (2, 1, 0),
        (3, 0, 1),
    ]
    row = split_spec((8, 12), 1, 2, 4)
    assert (
        row.offsets == (0, 6)
        and row.shape == (8, 3)
        and row.region()
        == (
            slice(0, 8),
            slice(6, 9),
        )
    )
    with pytest.raises(ConfigError, match="fc=10 is not divisible by tp=4"):
        split_spec((10, 3), 0, 0, 4, what="fc")


@pytest.mark.parametrize("shape", [(3, 8, 5), (3, 4, 8, 8)])
def test_sharded_dropout_is_a_slice_of_the_whole_mask(shape) -> None:
    """(b, s, h) split by sequence, (b, a, s, s) split by head: masks are exact slices."""
    keys = torch.tensor([1, 2, 3])
    whole = KeyedDropout(0.3, site=5).train()(torch.ones(shape), keys)
    for n in (2, 4):
        parts = []
        for r in range(n):
            drop = ShardedDropout(0.3, 5, dim=1, rank=r, size=n).train()
            parts.append(drop(torch.ones(shape).chunk(n, dim=1)[r], keys))
        assert torch.equal(torch.cat(parts, dim=1), whole)


def test_check_tensor_parallel_names_the_values() -> None:
    gpt, llama = get_preset("tiny-gpt"), get_preset("tiny-llama")  # 4 heads; llama kv 2
    check_tensor_parallel(gpt, 4, sequence_parallel=True, seq_len=32)
    check_tensor_parallel(llama, 2)
    with pytest.raises(ConfigError, match=r"model.n_heads=4 is not divisible by tp=3"):
        check_tensor_parallel(gpt, 3)
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 is not divisible by tp=4"):
        check_tensor_parallel(llama, 4)
    llama.n_heads, llama.n_kv_heads, llama.ffn_hidden = 8, 8, 100
    with pytest.raises(ConfigError, match=r"ffn_hidden\)=100 is not divisible by tp=8"):
        check_tensor_parallel(llama, 8)
    with pytest.raises(ConfigError, match=r"train.seq_len=30 is not divisible by tp=4"):
        check_tensor_parallel(gpt, 4, sequence_parallel=True, seq_len=30)
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        check_tensor_parallel(gpt, 0)
