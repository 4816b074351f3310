"""Tests for assign_buckets (parallel/zero/layout.py): grouping parameters into buckets."""

from __future__ import annotations

import torch
from torch import nn

from plait.parallel.zero.layout import assign_buckets


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
