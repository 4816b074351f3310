"""Tests for plait.parallel.buckets: grouping parameters and laying out flat buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.parallel.buckets import Bucket, assign_buckets, build_buckets


def params_of(*numels: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(n, dtype=dtype)) for n in numels]


def ids(groups: list[list[nn.Parameter]]) -> list[list[int]]:
    return [[id(p) for p in g] for g in groups]


# --- assign_buckets -----------------------------------------------------------------------


def test_reverse_order_and_one_bucket_when_everything_fits() -> None:
    ps = params_of(3, 5, 7)
    groups = assign_buckets(ps, bucket_bytes=10**6)
    assert ids(groups) == [[id(ps[2]), id(ps[1]), id(ps[0])]]


def test_byte_cap_is_respected() -> None:
    ps = params_of(4, 4, 4, 4, 4)  # 16 bytes each in fp32
    groups = assign_buckets(ps, bucket_bytes=40)  # two fit (32), three do not (48)
    assert ids(groups) == [
        [id(ps[4]), id(ps[3])],
        [id(ps[2]), id(ps[1])],
        [id(ps[0])],
    ]
    for g in groups:
        assert sum(p.numel() * p.element_size() for p in g) <= 40


def test_cap_is_inclusive() -> None:
    ps = params_of(4, 4, 4)
    assert [len(g) for g in assign_buckets(ps, bucket_bytes=32)] == [2, 1]  # 32 <= 32


def test_element_size_counts() -> None:
    ps = params_of(4, 4, 4, 4, dtype=torch.float64)  # 32 bytes each
    assert [len(g) for g in assign_buckets(ps, bucket_bytes=64)] == [2, 2]
    ps = params_of(4, 4, 4, 4, dtype=torch.bfloat16)  # 8 bytes each
    assert [len(g) for g in assign_buckets(ps, bucket_bytes=64)] == [4]


def test_oversized_parameter_gets_its_own_bucket() -> None:
    small_a, big, small_b, small_c = params_of(2, 100, 2, 2)  # 8, 400, 8, 8 bytes
    groups = assign_buckets([small_a, big, small_b, small_c], bucket_bytes=20)
    assert ids(groups) == [[id(small_c), id(small_b)], [id(big)], [id(small_a)]]


def test_oversized_first_and_last() -> None:
    big1, s, big2 = params_of(50, 1, 50)
    groups = assign_buckets([big1, s, big2], bucket_bytes=16)
    assert ids(groups) == [[id(big2)], [id(s)], [id(big1)]]


def test_every_parameter_exactly_once() -> None:
    ps = params_of(*range(1, 30))
    groups = assign_buckets(ps, bucket_bytes=50)
    flat = [id(p) for g in groups for p in g]
    assert flat == [id(p) for p in reversed(ps)]
    assert all(g for g in groups)


def test_no_parameters_no_buckets() -> None:
    assert assign_buckets([], bucket_bytes=100) == []
    assert build_buckets([], bucket_bytes=100) == []


# --- build_buckets ------------------------------------------------------------------------


def test_views_alias_the_buffer_at_the_right_offsets() -> None:
    a = nn.Parameter(torch.randn(2, 3))
    b = nn.Parameter(torch.randn(4))
    c = nn.Parameter(torch.randn(3, 1, 2))
    (bucket,) = build_buckets([a, b, c], bucket_bytes=10**6)
    assert isinstance(bucket, Bucket)
    assert bucket.index == 0
    assert [id(p) for p in bucket.params] == [id(c), id(b), id(a)]
    assert bucket.offsets == [0, 6, 10]
    assert bucket.numel == 16 and bucket.buffer.numel() == 16 and bucket.padding == 0
    for p, view, offset in zip(bucket.params, bucket.views, bucket.offsets, strict=True):
        assert view.shape == p.shape
        assert view.dtype == p.dtype
        assert view.data_ptr() == bucket.buffer.data_ptr() + offset * bucket.buffer.element_size()
    # Writing through a view lands in the buffer at that parameter's span, and vice versa.
    bucket.views[1].fill_(7.0)
    assert torch.equal(bucket.buffer[6:10], torch.full((4,), 7.0))
    assert bucket.buffer[:6].abs().sum() == 0 and bucket.buffer[10:].abs().sum() == 0
    bucket.buffer[10:16] = torch.arange(6.0)
    assert torch.equal(bucket.views[2], torch.arange(6.0).view(2, 3))


def test_buffers_are_zero_initialised() -> None:
    ps = params_of(5, 6, 7)
    for p in ps:
        p.grad = torch.ones_like(p)  # existing grads must not leak into the buffer
    for bucket in build_buckets(ps, bucket_bytes=30, pad_multiple=4):
        assert torch.count_nonzero(bucket.buffer) == 0
        assert bucket.pending == 0 and not bucket.launched and bucket.handle is None


@pytest.mark.parametrize(
    ("numel", "multiple", "padded"), [(10, 1, 10), (10, 4, 12), (12, 4, 12), (1, 8, 8), (9, 3, 9)]
)
def test_padding_to_a_multiple(numel: int, multiple: int, padded: int) -> None:
    ps = params_of(numel - 1, 1) if numel > 1 else params_of(1)
    (bucket,) = build_buckets(ps, bucket_bytes=10**6, pad_multiple=multiple)
    assert bucket.numel == numel
    assert bucket.buffer.numel() == padded
    assert bucket.padding == padded - numel
    # Views cover exactly the unpadded prefix.
    end = bucket.offsets[-1] + bucket.params[-1].numel()
    assert end == numel


def test_buckets_are_indexed_and_separate() -> None:
    ps = params_of(4, 4, 4, 4, 4)
    buckets = build_buckets(ps, bucket_bytes=40, pad_multiple=3)
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [b.numel for b in buckets] == [8, 8, 4]
    assert [b.buffer.numel() for b in buckets] == [9, 9, 6]
    ptrs = {b.buffer.data_ptr() for b in buckets}
    assert len(ptrs) == 3
    assert [id(p) for b in buckets for p in b.params] == [id(p) for p in reversed(ps)]


def test_buffer_dtype_defaults_to_the_parameters_and_can_be_overridden() -> None:
    ps = params_of(3, 3, dtype=torch.bfloat16)
    (bucket,) = build_buckets(ps, bucket_bytes=10**6)
    assert bucket.buffer.dtype == torch.bfloat16
    (bucket,) = build_buckets(ps, bucket_bytes=10**6, dtype=torch.float32)
    assert bucket.buffer.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in bucket.views)
    assert all(v.shape == p.shape for v, p in zip(bucket.views, bucket.params, strict=True))
