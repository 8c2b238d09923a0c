"""Gossip topologies and mixing weights: the properties CHOCO relies on, for n = 1 .. 9."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip.graphs import GRAPHS, adjacency, neighbours, offsets
from qcomm.collectives.gossip.mixing import (
    MIXINGS,
    mixing_matrix,
    spectral_gap,
    weights_from_adjacency,
)

NS = range(1, 10)


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("n", NS)
def test_graph_undirected_connected_regular(graph: str, n: int) -> None:
    adj = adjacency(graph, n)
    for i, nb in enumerate(adj):
        assert i not in nb and nb == sorted(set(nb))
        assert all(i in adj[j] for j in nb), "undirected"
    assert len({len(nb) for nb in adj}) == 1, "circulant graphs are regular"
    seen, frontier = {0}, [0]  # connected: a walk from node 0 reaches everyone
    while frontier:
        frontier = [j for i in frontier for j in adj[i] if j not in seen]
        seen |= set(frontier)
    assert seen == set(range(n))


@pytest.mark.parametrize("n", NS)
def test_degrees(n: int) -> None:
    assert len(neighbours("ring", 0, n)) == min(2, n - 1)  # n = 2: one neighbour, not two
    assert len(neighbours("complete", 0, n)) == n - 1
    hops = {h for k in range(4) if (h := 2**k) < n} | {n - 2**k for k in range(4) if 2**k < n}
    assert len(neighbours("exponential", 0, n)) == len({h % n for h in hops} - {0})


def test_exponential_examples() -> None:
    assert neighbours("exponential", 0, 8) == [1, 2, 4, 6, 7]
    assert neighbours("exponential", 3, 9) == [1, 2, 4, 5, 7, 8]  # 3 +- 1, 2, 4, 8 (mod 9)
    assert offsets("exponential", 2) == [1]


@pytest.mark.parametrize("mixing", MIXINGS)
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("n", NS)
def test_mixing_symmetric_doubly_stochastic_gap(graph: str, mixing: str, n: int) -> None:
    w = mixing_matrix(graph, n, mixing)
    assert w.dtype == torch.float64 and w.shape == (n, n)
    assert torch.equal(w, w.T)
    ones = torch.ones(n, dtype=torch.float64)
    # One float64 rounding per entry of the row sum: 1e-15 is a few ulps of 1.
    torch.testing.assert_close(w.sum(0), ones, rtol=0, atol=1e-15)
    torch.testing.assert_close(w.sum(1), ones, rtol=0, atol=1e-15)
    assert (w >= 0).all()
    adj = adjacency(graph, n)
    for i in range(n):  # support = the graph plus self loops
        assert {j for j in range(n) if w[i, j] > 0} == set(adj[i]) | {i}
    gap = spectral_gap(w)
    assert gap > 1e-3, (graph, n, gap)
    # Rough known values: complete graph averages in one round.
    if graph == "complete" or n <= 3:
        assert gap == pytest.approx(1.0, abs=1e-12)


def test_metropolis_irregular_and_uniform_refused() -> None:
    star = [[1, 2, 3], [0], [0], [0]]
    w = weights_from_adjacency(star, "metropolis")
    assert torch.equal(w, w.T)
    torch.testing.assert_close(w.sum(1), torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="regular"):
        weights_from_adjacency(star, "uniform")
    with pytest.raises(ValueError, match="undirected"):
        weights_from_adjacency([[1], []], "metropolis")


def test_bad_names() -> None:
    with pytest.raises(ValueError, match="graph must be one of"):
        neighbours("star", 0, 4)
    with pytest.raises(ValueError, match="mixing must be one of"):
        mixing_matrix("ring", 4, "max-degree")
    with pytest.raises(ValueError, match="node must be"):
        neighbours("ring", 4, 4)
    with pytest.raises(ValueError, match="n \\(number of nodes\\)"):
        adjacency("ring", 0)
