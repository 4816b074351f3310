"""Which tokens of a packed row each context-parallel rank holds (parallel/cp/cut.py), pure:
head-tail pieces per document, short documents whole, every rank s/cp tokens."""

from __future__ import annotations

import pytest
import torch

from plait.parallel.cp.cut import cut, cut_row, documents_of


def test_one_document_is_cut_head_tail():
    """16 tokens over cp=2: pieces of 4, rank 0 the first and last, rank 1 the middle two."""
    assert cut_row([(0, 16)], 2) == [[0, 1, 2, 3, 12, 13, 14, 15], list(range(4, 12))]


def test_each_document_is_balanced_on_its_own():
    """Two documents of 8 over cp=2: each cut in four pieces of 2, paired head and tail."""
    held = cut_row([(0, 8), (8, 16)], 2)
    assert held == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]


def test_short_documents_go_whole_to_the_least_loaded_rank():
    """cp=2: documents under 4 tokens are not cut; the greedy gives each to the rank with
    fewer tokens (the lower rank on a tie)."""
    held = cut_row([(0, 3), (3, 5), (5, 8), (8, 10)], 2)
    assert held == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]


def test_a_long_documents_tail_is_assigned_like_a_short_one():
    """10 tokens over cp=2: four pieces of 2 (head-tail), the last 2 tokens left over go
    whole to a rank with room."""
    held = cut_row([(0, 10)], 2)
    assert held == [[0, 1, 6, 7, 8], [2, 3, 4, 5, 9]]  # the tail split: each rank has 5


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_token_once_and_equal_shares(cp):
    gen = torch.Generator().manual_seed(cp)
    for _ in range(50):
        s = cp * int(torch.randint(1, 20, (1,), generator=gen))
        runs = torch.randint(0, 3, (2, s), generator=gen).cumsum(1)  # random documents
        index = cut(runs, cp)  # (cp, b, s/cp)
        assert index.shape == (cp, 2, s // cp)
        for row in range(2):
            assert sorted(index[:, row].flatten().tolist()) == list(range(s))


def test_documents_of_reads_runs():
    assert documents_of([1, 1, 2, 3, 3, 3]) == [(0, 2), (2, 3), (3, 6)]


def test_a_row_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="a row of 10 tokens does not split over cp=3"):
        cut_row([(0, 10)], 3)
