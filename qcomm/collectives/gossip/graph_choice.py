"""Which gossip graph a run uses: the one its options name, or one chosen by the node count.

``CommOptions(graph=None)`` (the default) leaves the choice to :func:`choose_graph`, made when
the node count is known (the engine's first distributed step):

* bounded staleness (lockstep), up to ``ONE_PEER_FROM - 1`` nodes: ``"ring"``, as before;
* bounded staleness from :data:`ONE_PEER_FROM` nodes: ``"one-peer-exp"`` (:mod:`.schedules`),
  one message per node and round, whose rounds to consensus grow as log2 N (the ring's as N^2);
* wait-free: ``"ring"`` at any N (that mode takes no time-varying graph).

The threshold is measured (docs/gossip_tuning.md, "The default graph by node count").
"""

from __future__ import annotations

from qcomm.validation import check_choice, check_int

from .graphs import GRAPHS, TIME_VARYING_GRAPHS
from .schedules import ALL_GRAPHS

__all__ = ["ONE_PEER_FROM", "check_option_graph", "choose_graph", "option_graphs"]

# Rounds to 1e-3 from independent starts, 4-bit stochastic codes, staleness 1 (the default),
# 1024 floats, seed 0, in the simulator: ring 38 / 56 / 76 / 99 at 5 / 6 / 7 / 8 nodes,
# one-peer-exp 76 / 60 / 43 / 28 (and 23 against 24 at 4 nodes). The one-peer graph sends half
# the ring's bytes per round; it takes fewer rounds from 7 nodes on.
ONE_PEER_FROM = 7


def option_graphs(wait_free: bool) -> tuple[str, ...]:
    """The graphs a run of that mode takes: every graph in lockstep, the static ones only
    wait-free."""
    return GRAPHS if wait_free else ALL_GRAPHS


def check_option_graph(graph: object, wait_free: bool) -> str | None:
    """``graph`` if a run of that mode (``wait_free``: bool) takes it, or None (chosen by the
    node count); else ValueError naming ``graph`` and the allowed values."""
    if wait_free and isinstance(graph, str) and graph in TIME_VARYING_GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS} or None with wait_free=True, got "
                         f"{graph!r}: the wait-free mode takes no time-varying graph")
    return check_choice("graph", graph, option_graphs(wait_free),  # type: ignore[return-value]
                        allow_none=True)


def choose_graph(graph: str | None, num_nodes: int, wait_free: bool) -> tuple[str, str]:
    """The graph a run of ``num_nodes`` (int >= 1) nodes gossips over, and why, in words for
    the layout log line.

    Args:
        graph: the options' graph; None: chosen here by the node count and the mode.
        num_nodes: the nodes of the run (the members of a rail).
        wait_free: the run's mode.

    Returns:
        ``(graph, why)``: a name of :data:`~.schedules.ALL_GRAPHS`, and a phrase.
    """
    check_int("num_nodes", num_nodes, low=1)
    if graph is not None:
        return check_option_graph(graph, wait_free), "as the options name it"  # type: ignore
    if wait_free:
        return "ring", "the wait-free mode's default at any node count"
    if num_nodes < ONE_PEER_FROM:
        return "ring", (f"{num_nodes} nodes: the default below {ONE_PEER_FROM}, where it "
                        "reaches consensus in as few rounds as the one-peer graph")
    return "one-peer-exp", (f"{num_nodes} nodes: one message per node and round, rounds to "
                            "consensus grow as log2 N (the ring's as N^2)")
