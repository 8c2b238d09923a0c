"""The one-peer exponential schedule: pairing, matrices, and the exact butterfly average."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip.graphs import GRAPHS, check_graph, neighbours
from qcomm.collectives.gossip.schedules import (
    ALL_GRAPHS,
    check_any_graph,
    hops,
    one_peer_average,
    one_peer_matrix,
    one_peer_partner,
    one_peer_peers,
)

NS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16]


def test_hops_is_ceil_log2() -> None:
    assert [hops(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 1000, 1024, 1025)] == \
        [0, 1, 2, 2, 3, 3, 4, 6, 10, 10, 11]


@pytest.mark.parametrize("n", NS)
def test_pairing_is_symmetric_and_a_matching(n: int) -> None:
    for t in range(2 * max(hops(n), 1) + 1):
        partners = [one_peer_partner(i, t, n) for i in range(n)]
        for i, p in enumerate(partners):
            if p is not None:
                assert p != i and 0 <= p < n
                assert partners[p] == i, "both ends agree from the round number alone"
        # Power of two: nobody sits out. Otherwise only nodes whose XOR partner is >= n do.
        sitting = [i for i, p in enumerate(partners) if p is None]
        k = t % hops(n) if n > 1 else 0
        assert sitting == [i for i in range(n) if n == 1 or i ^ (1 << k) >= n]


@pytest.mark.parametrize("n", NS)
def test_peers_ever_used_and_period(n: int) -> None:
    for i in range(n):
        peers = one_peer_peers(i, n)
        assert len(peers) <= hops(n)
        assert all(i in one_peer_peers(p, n) for p in peers)
        # the schedule repeats with period K
        assert all(one_peer_partner(i, t, n) == one_peer_partner(i, t + hops(n), n)
                   for t in range(hops(n)))
    if n & (n - 1) == 0:
        assert all(len(one_peer_peers(i, n)) == hops(n) for i in range(n))


@pytest.mark.parametrize("n", NS)
def test_round_matrices_symmetric_doubly_stochastic_and_connected(n: int) -> None:
    ones = torch.ones(n, dtype=torch.float64)
    union = torch.zeros(n, n, dtype=torch.bool)
    for t in range(max(hops(n), 1)):
        w = one_peer_matrix(t, n)
        assert w.dtype == torch.float64 and torch.equal(w, w.T)
        assert torch.equal(w.sum(0), ones) and torch.equal(w.sum(1), ones)
        assert ((w > 0).sum(1) <= 2).all(), "one peer per round"
        union |= w > 0
    seen, frontier = {0}, [0]  # the K rounds' edges connect the group
    while frontier:
        frontier = [j for i in frontier for j in range(n) if union[i, j] and j not in seen]
        seen |= set(frontier)
    assert seen == set(range(n))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_exact_average_in_log2_n_rounds(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    xs = torch.randn(n, 33, generator=g, dtype=torch.float64)
    mean = xs.mean(0)
    k = hops(n)
    before = one_peer_average(xs, k - 1)
    after = one_peer_average(xs, k)
    # K rounds: every node holds the same bits, the average up to float64 rounding (K halvings
    # of sums of values of size ~4).
    assert all(torch.equal(after[i], after[0]) for i in range(n))
    torch.testing.assert_close(after[0], mean, rtol=0, atol=1e-14)
    if n > 2:  # K - 1 rounds: only blocks of n / 2 nodes are averaged, far from the mean
        assert float((before - mean).abs().max()) > 0.1
    # the same as the product of the round matrices, and the start is not changed
    w = torch.linalg.multi_dot([one_peer_matrix(t, n) for t in reversed(range(k))]) \
        if k > 1 else one_peer_matrix(0, n)
    torch.testing.assert_close(w, torch.full((n, n), 1 / n, dtype=torch.float64))
    assert torch.equal(xs, torch.randn(n, 33, generator=torch.Generator().manual_seed(n),
                                       dtype=torch.float64))


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_other_n_converge_and_keep_the_average(n: int) -> None:
    xs = torch.randn(n, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = one_peer_average(xs, 60 * hops(n))
    torch.testing.assert_close(out.mean(0), xs.mean(0), rtol=0, atol=1e-13)
    torch.testing.assert_close(out, xs.mean(0).expand(n, 8), rtol=0, atol=1e-9)
    # not exact after K rounds: a node that sat out lags
    assert float((one_peer_average(xs, hops(n)) - xs.mean(0)).abs().max()) > 1e-3


def test_static_checks_refuse_the_time_varying_graph() -> None:
    assert check_any_graph("one-peer-exp") == "one-peer-exp"
    assert set(GRAPHS) < set(ALL_GRAPHS)
    with pytest.raises(ValueError, match=r"graph must be one of \('ring', 'exponential', "
                                         r"'complete'\) here, got 'one-peer-exp'"):
        check_graph("one-peer-exp")
    with pytest.raises(ValueError, match="graph must be one of"):
        neighbours("one-peer-exp", 0, 8)  # no silent static fallback
    with pytest.raises(ValueError, match="graph must be one of"):
        check_any_graph("one-peer")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 5])
def test_every_fragment_meets_every_peer_in_its_own_k_rounds(n: int, fragments: int) -> None:
    k = hops(n)
    for i in range(n):
        for f in range(fragments):
            met = {one_peer_partner(i, f + fragments * j, n, fragments) for j in range(k)}
            assert met - {None} == set(one_peer_peers(i, n))
        # one fragment a round: every fragment takes a hop before the next hop starts
        assert [one_peer_partner(i, t, n, fragments) for t in range(fragments)] == \
            [one_peer_partner(i, 0, n)] * fragments


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fragments must be"):
        one_peer_partner(0, 0, 4, 0)
    with pytest.raises(ValueError, match="node must be"):
        one_peer_partner(4, 0, 4)
    with pytest.raises(ValueError, match="round must be"):
        one_peer_partner(0, -1, 4)
    with pytest.raises(ValueError, match=r"n \(number of nodes\)"):
        hops(0)
