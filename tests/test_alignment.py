"""Character-span token alignment on hand-made tokenizations."""

import numpy as np
import pytest
import torch

from cachecert_agents.kv.alignment import align_tokens

TEXT = "the cat sat"


def spans(*pieces):
    out, pos = [], 0
    for p in pieces:
        start = TEXT.index(p, pos)
        out.append((start, start + len(p)))
        pos = start + len(p)
    return out


def test_identical_tokenizations_give_identity():
    s = spans("the", " cat", " sat")
    a = align_tokens(s, s)
    assert a.is_identity
    assert a.coverage()["one_to_one_fraction"] == 1.0
    assert torch.equal(a.pooling_matrix(), torch.eye(3))


def test_coarse_receiver_pools_fine_sender():
    receiver = spans("the cat", " sat")
    sender = spans("th", "e", " c", "at", " s", "at")
    a = align_tokens(receiver, sender)
    assert a.senders_of(0).tolist() == [0, 1, 2, 3]
    assert a.senders_of(1).tolist() == [4, 5]
    pool = a.pooling_matrix()
    assert torch.allclose(pool.sum(1), torch.ones(2))
    assert pool[0, 0] == pytest.approx(2 / 7) and pool[0, 1] == pytest.approx(1 / 7)
    cov = a.coverage()
    assert cov["covered_fraction"] == 1.0 and cov["char_coverage"] == 1.0
    assert cov["mean_senders_per_receiver"] == 3.0 and cov["one_to_one_fraction"] == 0.0


def test_straddling_tokens_overlap_both_neighbours():
    receiver = spans("the c", "at sat")
    sender = spans("the", " cat", " sat")
    a = align_tokens(receiver, sender)
    assert a.senders_of(0).tolist() == [0, 1] and a.senders_of(1).tolist() == [1, 2]
    assert a.overlap.tolist() == [3, 2, 2, 4]


def test_zero_width_special_tokens_overlap_nothing():
    receiver = [(0, 0)] + spans("the", " cat", " sat")  # BOS first
    sender = spans("the", " cat", " sat")
    a = align_tokens(receiver, sender)
    assert a.senders_of(0).size == 0
    assert [a.senders_of(i).tolist() for i in (1, 2, 3)] == [[0], [1], [2]]
    assert a.coverage()["covered_fraction"] == 1.0  # zero-width tokens are not counted
    assert a.pooling_matrix()[0].sum() == 0


def test_gap_in_sender_lowers_coverage():
    receiver = spans("the", " cat", " sat")
    sender = spans("the", " sat")
    cov = align_tokens(receiver, sender).coverage()
    assert cov["covered_fraction"] == pytest.approx(2 / 3)
    assert cov["char_coverage"] == pytest.approx(7 / 11)


def test_bad_offsets_are_rejected():
    with pytest.raises(ValueError, match="\\[n, 2\\]"):
        align_tokens(np.zeros((3, 3)), spans("the"))
    with pytest.raises(ValueError, match="increasing"):
        align_tokens([(4, 7), (0, 3)], spans("the"))


def test_sparse_pool_equals_dense_pooling_matrix():
    receiver = [(0, 0)] + spans("the c", "at sat")
    sender = spans("th", "e", " c", "at", " s", "at")
    a = align_tokens(receiver, sender)
    x = torch.randn(len(sender), 5)
    assert torch.allclose(a.pool(x), a.pooling_matrix() @ x, atol=1e-6)
