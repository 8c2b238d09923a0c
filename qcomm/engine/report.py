"""What the engine tells: the topology it detected (logged once) and its statistics."""

from __future__ import annotations

import logging
import sys
from typing import Any

from qcomm.collectives.gossip.factory import gossip_class
from qcomm.collectives.gossip.member import GossipMember
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.engine.options import CommOptions

__all__ = ["engine_stats", "log_topology", "lost_and_back"]

log = logging.getLogger("qcomm")


def lost_and_back(dropped: list[int], rejoined: list[int]) -> tuple[list[int], list[int]]:
    """The ranks still lost and those lost that came back, from ``stats()``'s
    ``dropped_ranks`` and ``rejoined_ranks`` (one entry per loss, per return): a rank is back
    when it returned as often as it was dropped, so one lost again after its return is lost."""
    still, back = [], []
    for rank in sorted(set(dropped)):
        (back if rejoined.count(rank) >= dropped.count(rank) else still).append(rank)
    return still, back


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _schedule(options: CommOptions, gamma: float | None, num_nodes: int) -> str:
    """The gossip's schedule in words: how often, in what pieces, how stale, which step."""
    every = ("every step" if options.sync_every == 1
             else f"every part once every {options.sync_every} steps")
    pieces = f" in {options.fragments} fragments" if options.fragments > 1 else ""
    step = f"gamma {gamma:g}" if gamma is not None else "gamma default"
    outer = (f", outer Nesterov momentum {options.outer_momentum:g} lr {options.outer_lr:g}"
             if options.outer_momentum else "")
    if outer and options.total_steps is not None:
        outer += f" annealed over {options.total_steps} steps"
    config = options.gossip_config(num_nodes)
    mode = gossip_class(config).mode_words(config)
    return f"gossip {every}{pieces}, {mode}, {step}{outer}"


def topology_line(topology: Topology, options: CommOptions, ddp_intra: bool, gossiped: int,
                  gamma: float | None = None, *, sharded: bool = False) -> tuple[int, str]:
    """(logging level, the sentence) that says how this job communicates: nodes and ranks,
    what is averaged how on which link, the graph and why, and the gossip's schedule. One
    node is a warning: nothing crosses a slow link then. ``gossiped``: elements in this
    rank's flat buffer (with ``sharded``, FSDP2's parameters, its local parts only)."""
    L, N = topology.procs_per_node, topology.num_nodes
    intra = ("FSDP2's reduce-scatter" if sharded else "DDP in backward" if ddp_intra else
             f"{options.intra_bits}-bit" if options.intra_bits else "fp32")
    carried = ("each local rank's FSDP2 shard gossiped between nodes on its rail (rank 0's: "
               f"{gossiped} parameters)" if sharded
               else f"{gossiped} parameters gossiped between nodes")
    if N > 1:
        share = "" if sharded else f", each local rank carrying 1/{L} of them on its rail"
        graph, why = options.chosen_graph(N)
        links = topology.world.links()
        links = "" if links is None else f"; links between nodes: {links}"
        return logging.INFO, (
            f"qcomm: {_count(N, 'node')} x {_count(L, 'rank')}; gradients averaged inside "
            f"each node ({intra}); {carried} in {options.bits}-bit messages over a "
            f"{graph} graph ({why}){share}{links}; {_schedule(options, gamma, N)}")
    return logging.WARNING, (
        f"qcomm: 1 node x {_count(L, 'rank')}: gradients are averaged inside the node "
        f"({intra}) and nothing is compressed, since no link between nodes exists. To emulate "
        "several nodes on one machine pass procs_per_node=.")


def log_topology(topology: Topology, options: CommOptions, ddp_intra: bool,
                 gossiped: int, gamma: float | None = None, *, sharded: bool = False) -> None:
    """On rank 0, once: :func:`topology_line` on logger ``qcomm``. Where logging was never
    configured (no handler on the way to the root logger) Python would drop an INFO record,
    so the line goes to stderr instead: a user sees what qcomm detected either way."""
    if topology.rank != 0:
        return
    level, line = topology_line(topology, options, ddp_intra, gossiped, gamma,
                                sharded=sharded)
    if log.hasHandlers():
        log.log(level, line)
    else:
        print(line, file=sys.stderr, flush=True)


def per_fragment(rounds: int, fragments: int) -> list[int]:
    """Rounds started per fragment after ``rounds`` rounds (round t carries t % fragments)."""
    return [rounds // fragments + (1 if f < rounds % fragments else 0) for f in range(fragments)]


def engine_stats(steps: int, skipped_steps: int, comm_stats: CommStats, gossip: Any,
                 kind: type[GossipMember], options: CommOptions, *,
                 consensus_of: Any = None) -> dict[str, Any]:
    """The dict :meth:`qcomm.engine.AveragingEngine.stats` returns: what this rank sent and how
    the gossip is doing.

    Args:
        steps, skipped_steps: the engine's counters.
        comm_stats: the bytes and messages counted.
        gossip: the gossip member, None before there is one; ``kind``: its class (the mode's
            own statistics come from either).
        options: the communication options.
        consensus_of: the :class:`~qcomm.engine.node_gossip.NodeGossip` whose consensus
            distance to compute (a collective over the rail), or None.

    Returns:
        dict with ``steps`` (applied), ``skipped_steps``, ``bytes_sent`` and ``messages_sent``
        (``{"intra": int, "inter": int}``), ``staleness`` (rounds a gossip round stays in
        flight), ``gossip_rounds`` (started), ``fragment_rounds`` (rounds started per
        fragment, a list of ``fragments`` ints), ``gamma`` (the gossip's consensus step, None
        without gossip) and ``consensus_distance`` (``sqrt(mean_i ||x_i - mean x||^2)`` over
        nodes, float, or None when not asked for or with one node). With ``wait_free`` also
        ``rounds_received`` and ``lag_rounds``: per neighbour on this rank's rail (its global
        rank), the rounds of it applied here and how many rounds this rank has started beyond
        them; ``live_nodes``, ``dropped_ranks`` (one entry per neighbour dropped here),
        ``rejoined_ranks`` (one per dropped neighbour that joined again: nodes linked through
        the rendezvous, :func:`lost_and_back`); ``terms_paired``: ``{"paired": n,
        "possible": m}``, the neighbour terms this rank's rounds added, against one per live
        neighbour per round (docs/engine.md, "Wait-free gossip"); ``mix_lag_rounds``: ``{s:
        rounds}``, how many of this rank's rounds mixed the fragment of the round s before
        them (``staleness`` when every neighbour's message of that round came in time).
    """
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
        "consensus_distance": None,
    }
    out.update(g.mode_stats() if g is not None else kind.idle_stats())
    if consensus_of is not None:
        out["consensus_distance"] = consensus_of.consensus_distance()
    return out
