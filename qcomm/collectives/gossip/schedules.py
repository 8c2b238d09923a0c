"""Time-varying gossip graphs: who exchanges with whom in round ``t``.

The graphs of :mod:`.graphs` are static: every round, every node talks to all its neighbours.
A *one-peer* schedule instead gives every node at most one peer per round, so a round costs a
node one message whatever ``n``, and changes the pairing from round to round so that
information still spreads over the whole group.

``"one-peer-exp"`` (the one-peer exponential graph): with ``K = ceil(log2 n)`` hops, in round
``t`` node ``i`` is paired with

    partner(i, t) = i XOR 2**(t mod K)        (when that is < n; else i sits the round out)

(``2**((t // F) mod K)`` for a gossip of F fragments, one per round: :func:`one_peer_partner`.)

* Symmetric without coordination: XOR with a fixed mask is its own inverse, so
  ``partner(partner(i, t), t) == i`` and both ends derive the same pair from the round number
  alone; no node is paired twice in one round.
* ``n`` a power of two: every node has a partner every round, and averaging each pair with
  weight 1/2 averages one bit of the node index per round, so after the K rounds ``t = 0 .. K-1``
  every node holds the exact average (the hypercube "butterfly"; :func:`one_peer_average`).
* Other ``n``: a node whose partner would be ``>= n`` keeps its value that round (its row of
  the round's mixing matrix is the identity). The K rounds' edges still connect the group
  (clearing the highest set bit of ``i`` leads to a smaller node, down to 0), so repeated
  rounds converge to the average, only not in exactly K rounds.

Weights: each pair mixes with weight 1/2 (:func:`one_peer_matrix`): every round's matrix is
symmetric and doubly stochastic, so the average is preserved round by round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.validation import check_choice, check_int

from .graphs import GRAPHS, TIME_VARYING_GRAPHS

__all__ = ["ALL_GRAPHS", "ONE_PEER_GAMMA", "TIME_VARYING_GRAPHS", "WAIT_FREE_ONE_PEER_GAMMA",
           "check_any_graph",
           "check_time_varying_graph", "hops", "live_partner",
           "one_peer_average", "one_peer_gamma", "one_peer_matrix", "one_peer_partner",
           "one_peer_peers"]

ALL_GRAPHS = GRAPHS + TIME_VARYING_GRAPHS

# Default consensus step by staleness with a codec, from rounds to 1e-3 at 4 bits from
# independent starts (seed 0, gamma 0.3 .. 1.0 by 0.1 at n = 16 and 64, then the best
# neighbours at n = 64 and 256): staleness 0: 0.8 (1.0 still converges); staleness 1: 0.55
# and 0.6 tie (47 / 48 rounds at n = 64, 56 / 57 at 256), 0.8 still converges, 0.9 does not.
# Larger than the static graphs' default (:func:`~qcomm.collectives.gossip.default_gamma`): a
# pair's weight is 1/2 and a link is used again only K rounds later, so a small step leaves
# most of a pair's difference waiting that long. Staleness > 1, not measured: shrunk like
# 1 / staleness. Uncompressed at staleness 0: 1.0, the exact pairwise average.
ONE_PEER_GAMMA = {0: 0.8, 1: 0.55}

# The wait-free one-peer gossip's default step (OnePeerWaitFree: a term's partner copy is the
# latest that arrived, a link's previous exchange when the messages cross on the wire). Rounds
# to 1e-3 at 4 bits from independent starts, 1024 floats, seed 0, one pace, messages visible a
# tick later, n = 16: gamma 0.2 / 0.25 / 0.3 / 0.35 / 0.4 / 0.45 / 0.55 / 0.7: 101 / 75 / 56 /
# 46 / 46 / 51 / 62 / 77.
WAIT_FREE_ONE_PEER_GAMMA = 0.4


def one_peer_gamma(staleness: int, compressed: bool = True) -> float:
    """The default consensus step on ``"one-peer-exp"`` for messages applied ``staleness``
    (int >= 0) rounds late: :data:`ONE_PEER_GAMMA`, 1.0 for uncompressed messages at staleness
    0 (each pair then averages exactly), shrunk like 1 / staleness past the measured range."""
    if not compressed and staleness == 0:
        return 1.0
    return ONE_PEER_GAMMA[staleness] if staleness in ONE_PEER_GAMMA else 0.55 / staleness


def check_any_graph(graph: object) -> str:
    """Return ``graph`` if it names a static (:data:`~.graphs.GRAPHS`) or a time-varying graph,
    else raise ValueError naming the argument and the allowed values."""
    return check_choice("graph", graph, ALL_GRAPHS)  # type: ignore[return-value]


def check_time_varying_graph(graph: object) -> str:
    """Return ``graph`` if it names a time-varying graph, else raise ValueError naming the
    argument and the allowed values (what a member made for such a graph takes)."""
    return check_choice("graph", graph, TIME_VARYING_GRAPHS)  # type: ignore[return-value]


def _check_n(n: object) -> int:
    return check_int("n (number of nodes)", n, low=1)  # type: ignore[return-value]


def hops(n: int) -> int:
    """``K = ceil(log2 n)``: the number of distinct hops ``2**k`` (k < K) of the schedule on
    ``n`` nodes, its period in rounds (0 for a single node, which never has a peer)."""
    return (_check_n(n) - 1).bit_length()


def one_peer_partner(node: int, round: int, n: int, fragments: int = 1) -> int | None:
    """``node``'s peer in ``round`` (int >= 0) of ``"one-peer-exp"`` over ``n`` nodes:
    ``node XOR 2**((round // fragments) mod K)``, or None when that is not a node (``>= n``)
    or ``n == 1``: the node sits the round out.

    ``fragments`` (int >= 1): a gossip that sends one fragment of its vector in turn per round
    (fragment ``round mod fragments``) takes the next hop only once every fragment has had a
    round on the current one, so each fragment meets all K peers in its own K rounds. With
    ``2**(round mod K)`` a fragment would meet only the hops ``f, f + F, ...`` mod K: at
    ``K == fragments`` (16 nodes, 4 fragments) always the same one, the group split into pairs
    that drift apart."""
    k = hops(n)
    check_int("node", node, low=0, high=n, high_open=True)
    check_int("round", round, low=0)
    check_int("fragments", fragments, low=1)
    if k == 0:
        return None
    peer = node ^ (1 << ((round // fragments) % k))
    return peer if peer < n else None


def live_partner(node: int, round: int, live: Sequence[int]) -> int | None:
    """``node``'s peer in ``round`` of ``"one-peer-exp"`` over the live members only:
    the schedule runs over their positions in ``live`` (member numbers, ascending, ``node``
    among them), so position r pairs with position ``r XOR 2**(round mod ceil(log2 L))``
    (L = ``len(live)``). Every member that holds the same ``live`` derives the same pairs; a
    lost member is never a partner, and L a power of two averages exactly in log2 L rounds.
    None: ``node`` sits the round out.

    Raises:
        ValueError: ``live`` is not ascending and distinct, or does not hold ``node``.
    """
    live = list(live)
    if any(not isinstance(m, int) for m in live) or live != sorted(set(live)):
        raise ValueError(f"live must be distinct member numbers, ascending, got {live}")
    if node not in live:
        raise ValueError(f"node must be one of the live members {live}, got {node!r}")
    q = one_peer_partner(live.index(node), round, len(live))
    return None if q is None else live[q]


def one_peer_peers(node: int, n: int) -> list[int]:
    """Every peer ``node`` ever has, ascending: at most K = ceil(log2 n) of them. A member
    that keeps per-link state (CHOCO's public copies) keeps one set per entry of this list."""
    return sorted({p for t in range(hops(n))
                   if (p := one_peer_partner(node, t, n)) is not None})


def one_peer_matrix(round: int, n: int) -> torch.Tensor:
    """float64 ``[n, n]`` mixing matrix of ``round``: 1/2 on each pair and on the diagonal of
    paired nodes, 1 on the diagonal of a node that sits out; symmetric, doubly stochastic."""
    w = torch.eye(_check_n(n), dtype=torch.float64)
    for i in range(n):
        p = one_peer_partner(i, round, n)
        if p is not None:
            w[i, i] = w[i, p] = 0.5
    return w


def one_peer_average(xs: torch.Tensor, rounds: int, first_round: int = 0) -> torch.Tensor:
    """Reference: ``rounds`` rounds of uncompressed pairwise averaging on the schedule, from
    ``first_round``. ``xs``: ``[n, ...]`` floating tensor (row i: node i's value), not changed;
    returns a new tensor of the same shape and dtype. Each pair computes ``(x_i + x_p) / 2``,
    the same expression at both ends, so the two ends hold the same bits after every round."""
    out = xs.clone()
    n = out.shape[0]
    for t in range(first_round, first_round + rounds):
        perm = [p if (p := one_peer_partner(i, t, n)) is not None else i for i in range(n)]
        out = (out + out[perm]) / 2  # a node that sits out averages with itself: unchanged
    return out
