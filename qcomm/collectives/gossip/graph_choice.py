"""Which gossip graph a run uses: the one its options name, or one chosen by the node count.

``CommOptions(graph=None)`` (the default) leaves the choice to :func:`choose_graph`, made when
the node count is known (the engine's first distributed step), in both modes alike (bounded
staleness: :class:`~.one_peer_choco.OnePeerGossip` on the one-peer graph; wait-free:
:class:`~.one_peer_wait_free.OnePeerWaitFree`):

* up to ``ONE_PEER_FROM - 1`` nodes: ``"ring"``, as before;
* from :data:`ONE_PEER_FROM` nodes: ``"one-peer-exp"`` (:mod:`.schedules`), one message per
  node and round, whose rounds to consensus grow as log2 N (the ring's as N^2).

The threshold is measured (docs/gossip_tuning.md, "The default graph by node count").
"""

from __future__ import annotations

from qcomm.validation import check_choice, check_int

from .schedules import ALL_GRAPHS

__all__ = ["ONE_PEER_FROM", "check_option_graph", "choose_graph"]

# Rounds to 1e-3 from independent starts, 4-bit stochastic codes, staleness 1 (the default),
# 1024 floats, seed 0, in the simulator: ring 38 / 56 / 76 / 99 at 5 / 6 / 7 / 8 nodes,
# one-peer-exp 76 / 60 / 43 / 28 (and 23 against 24 at 4 nodes). The one-peer graph sends half
# the ring's bytes per round; it takes fewer rounds from 7 nodes on. Wait-free (every member
# at one pace, messages visible one tick later, the one-peer graph at its gamma 0.4): ring 23 /
# 38 / 56 / 76 / 99 at 4 / 5 / 6 / 7 / 8 nodes, one-peer-exp 22 / 81 / 63 / 43 / 33 (381
# against 46 at 16): fewer rounds from 7 nodes on too.
ONE_PEER_FROM = 7


def check_option_graph(graph: object) -> str | None:
    """``graph`` if it names a graph (:data:`~.schedules.ALL_GRAPHS`, both modes take every
    one), or None (chosen by the node count); else ValueError naming ``graph`` and the allowed
    values."""
    return check_choice("graph", graph, ALL_GRAPHS, allow_none=True)  # type: ignore


def choose_graph(graph: str | None, num_nodes: int) -> tuple[str, str]:
    """The graph a run of ``num_nodes`` (int >= 1) nodes gossips over, and why, in words for
    the layout log line.

    Args:
        graph: the options' graph; None: chosen here by the node count.
        num_nodes: the nodes of the run (the members of a rail).

    Returns:
        ``(graph, why)``: a name of :data:`~.schedules.ALL_GRAPHS`, and a phrase.
    """
    check_int("num_nodes", num_nodes, low=1)
    if graph is not None:
        return check_option_graph(graph), "as the options name it"  # type: ignore[return-value]
    if num_nodes < ONE_PEER_FROM:
        return "ring", (f"{num_nodes} nodes: the default below {ONE_PEER_FROM}, where it "
                        "reaches consensus in as few rounds as the one-peer graph")
    return "one-peer-exp", (f"{num_nodes} nodes: one message per node and round, rounds to "
                            "consensus grow as log2 N (the ring's as N^2)")
