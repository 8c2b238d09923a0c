"""What the engine tells: the layout it detected (logged once) and its statistics."""

from __future__ import annotations

import logging
from typing import Any

from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.deprecation import DeprecatedKeys
from qcomm.engine.options import CommOptions

__all__ = ["engine_stats", "log_layout"]

log = logging.getLogger("qcomm")


def log_layout(topology: Topology, options: CommOptions, ddp_intra: bool,
               gossiped: int) -> None:
    """On rank 0: how many nodes and ranks, what is averaged how on which link. One node is a
    warning: nothing crosses a slow link then."""
    if topology.rank != 0:
        return
    L, N = topology.procs_per_node, topology.num_nodes
    intra = ("DDP in backward" if ddp_intra else
             f"{options.intra_bits}-bit" if options.intra_bits else "fp32")
    if N > 1:
        log.info("qcomm: %d nodes x %d ranks; gradients averaged inside each node (%s); "
                 "%d parameters gossiped between nodes in %d-bit messages over a %s graph, "
                 "each local rank carrying 1/%d of them on its rail%s", N, L, intra, gossiped,
                 options.bits, options.graph, L, ", wait-free" if options.wait_free else "")
    else:
        log.warning("qcomm: 1 node x %d ranks: gradients are averaged inside the node (%s) "
                    "and nothing is compressed, since no link between nodes exists. To "
                    "emulate several nodes on one machine pass procs_per_node=.", L, intra)


def per_fragment(rounds: int, fragments: int) -> list[int]:
    """Rounds started per fragment after ``rounds`` rounds (round t carries t % fragments)."""
    return [rounds // fragments + (1 if f < rounds % fragments else 0) for f in range(fragments)]


def engine_stats(steps: int, skipped_steps: int, comm_stats: CommStats, gossip: Any,
                 options: CommOptions) -> dict[str, Any]:
    """The dict :meth:`qcomm.engine.AveragingEngine.stats` returns (``consensus_distance``
    None: the engine fills it in when asked)."""
    snap = comm_stats.snapshot()
    g = gossip
    out: dict[str, Any] = {
        "steps": steps,
        "skipped_steps": skipped_steps,
        "bytes_sent": snap["bytes_sent"],
        "messages_sent": snap["messages_sent"],
        "staleness": g.staleness if g is not None else 0,
        "gossip_rounds": g.rounds_started if g is not None else 0,
        "fragment_rounds": per_fragment(g.rounds_started if g is not None else 0,
                                        options.fragments),
        "gamma": g.gamma if g is not None else None,
        "gossip_step": g.gamma if g is not None else None,  # deprecated alias of gamma
        "consensus_distance": None,
    }
    if options.wait_free:
        out["rounds_received"] = g.rounds_received() if g is not None else {}
        out["lag_rounds"] = g.lag() if g is not None else {}
        out["live_nodes"] = g.live_members() if g is not None else 1
        out["dropped_ranks"] = [e["rank"] for e in g.losses] if g is not None else []
    return DeprecatedKeys(out, {"gossip_step": "gamma"})
