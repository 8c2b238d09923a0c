"""Gossip topologies: who exchanges with whom among ``n`` nodes.

Every graph here is *undirected* (j is a neighbour of i iff i is one of j) and *circulant* (node
i's neighbours are ``i + o mod n`` for one set of offsets ``o``), hence regular: every node has the
same degree. Undirected is what CHOCO's symmetric mixing matrix needs; regular makes uniform
weights doubly stochastic (:mod:`.mixing`).

=============  =========================================  ============================
graph          neighbours of node i                       degree
=============  =========================================  ============================
ring           i - 1, i + 1 (mod n)                       2 (1 for n = 2, 0 for n = 1)
exponential    i +- 2**k (mod n) for 2**k < n             about 2 log2(n) - 1
complete       every other node                           n - 1
=============  =========================================  ============================

The exponential graph is the static exponential graph of Assran et al. 2019 (SGP) and Ying et al.
2021 made undirected (both directions of every hop) so that the weights can be symmetric: its
diameter is about log2(n) for about twice the ring's messages per round.

Time-varying graphs (a different pairing every round: :mod:`.schedules`) are named in
:data:`TIME_VARYING_GRAPHS` but are not graphs of this module: :func:`check_graph`, which the
static members (one public copy per static neighbour) and the engine's options use, refuses
them with that reason; the lockstep :class:`~.one_peer_choco.OnePeerGossip` takes them.
"""

from __future__ import annotations

from qcomm.validation import check_choice, check_int

GRAPHS = ("ring", "exponential", "complete")
# Only the lockstep OnePeerGossip (the engine's in lockstep) and the GossipSimulator take
# these yet (:mod:`.schedules`).
TIME_VARYING_GRAPHS = ("one-peer-exp",)


def check_graph(graph: object) -> str:
    """Return ``graph`` if it names a static graph (:data:`GRAPHS`), else raise ValueError
    naming the argument and the allowed values; a time-varying graph gets its own reason."""
    if isinstance(graph, str) and graph in TIME_VARYING_GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS} here, got {graph!r}: a time-varying "
                         f"graph changes its peers every round, which OnePeerGossip (lockstep) "
                         f"and OnePeerWaitFree take (build_gossip picks them)")
    return check_choice("graph", graph, GRAPHS)  # type: ignore[return-value]


def _check_n(n: object) -> int:
    return check_int("n (number of nodes)", n, low=1)  # type: ignore[return-value]


def offsets(graph: str, n: int) -> list[int]:
    """The circulant offsets of ``graph`` on ``n`` nodes: sorted, in ``[1, n)``, no duplicates."""
    check_graph(graph)
    _check_n(n)
    if graph == "ring":
        raw = {1, n - 1}
    elif graph == "complete":
        raw = set(range(1, n))
    else:  # exponential: every power-of-two hop, both directions
        raw = set()
        hop = 1
        while hop < n:
            raw |= {hop, n - hop}
            hop *= 2
    return sorted(o % n for o in raw if o % n)


def neighbours(graph: str, node: int, n: int) -> list[int]:
    """Neighbours of ``node`` (0-based, < n) in ``graph`` over ``n`` nodes, ascending, without
    ``node`` itself. ``n = 1`` has none; ``n = 2`` has one for every graph."""
    _check_n(n)
    check_int("node", node, low=0, high=n, high_open=True)
    return sorted({(node + o) % n for o in offsets(graph, n)})


def adjacency(graph: str, n: int) -> list[list[int]]:
    """``adjacency(graph, n)[i] == neighbours(graph, i, n)`` for every node i."""
    return [neighbours(graph, i, n) for i in range(_check_n(n))]
