"""The engine's checkpoint entry: what it holds, and whether a saved one may be loaded here.

One rank's entry (``optimizer.state_dict()["qcomm"]``)::

    {"format": 2,
     "world_size": int, "procs_per_node": int, "rank": int,   # the geometry it was saved in
     "steps": int, "skipped_steps": int,
     "comm": {option: value},                                 # CommOptions as a dict
     "gossip": CompressedGossip.state_dict() | None,          # rounds in flight included
     "intra": IntraNodeAllreduce.state_dict() | None,         # intra_bits residuals, call count
     "comm_stats": CommStats.snapshot()}

A run that lost nodes (``on_peer_loss="continue"``) and restarts with its survivors only (the
same ranks per node, nodes in the same order) loads exactly: the gossip goes on with the saved
run's member numbers, seeds and links, as if it had not stopped.

Otherwise, loading into a different geometry (world size or ranks per node), or a state saved
after nodes were lost into a run of the same size (its gossip links are not this run's graph):
``"error"`` refuses it; ``"reinit"`` restarts the gossip state (and then any rank may load any
rank's entry: a node that comes back loads a survivor's checkpoint). That drops nothing:
CHOCO's not-yet-communicated residual ``x - x_hat`` lives in the parameters themselves, and
the mixing corrections of rounds in flight sum to zero over the nodes, so the global mean of
the parameters is preserved. The intra_bits residuals are laid out for the old node and
cannot move: a non-zero one refuses.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from qcomm.collectives.topology import Topology
from qcomm.engine.options import WIRE_FIELDS, CommOptions
from qcomm.validation import check_choice

__all__ = ["STATE_FORMAT", "WORLD_CHANGE_MODES", "EngineStateFile", "check_loadable",
           "geometry"]

STATE_FORMAT = 2
READABLE_FORMATS = (STATE_FORMAT,)
WORLD_CHANGE_MODES = ("error", "reinit")


def geometry(procs_per_node: int | None, topology: Topology | None) -> tuple[int, int, int]:
    """(world size, ranks per node, rank) of this run, without any collective."""
    if topology is not None:
        return topology.world_size, topology.procs_per_node, topology.rank
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 1, 1, 0
    topo = Topology(procs_per_node)
    return topo.world_size, topo.procs_per_node, topo.rank


class EngineStateFile:
    """Builds the checkpoint entry (see the module docstring)."""

    @staticmethod
    def build(geom: tuple[int, int, int], *, steps: int, skipped_steps: int,
              options: CommOptions, gossip: dict | None, intra: dict | None,
              comm_stats: dict) -> dict[str, Any]:
        world, ppn, rank = geom
        return {"format": STATE_FORMAT, "world_size": world, "procs_per_node": ppn,
                "rank": rank, "steps": steps, "skipped_steps": skipped_steps,
                "comm": options.as_dict(), "gossip": gossip, "intra": intra,
                "comm_stats": comm_stats}


def _nonzero_residuals(intra: dict | None) -> bool:
    if intra is None:
        return False
    residuals = intra["error_feedback"]["residuals"].values()
    return any(t.numel() and bool(t.abs().max() > 0) for t in residuals)


def _check_wire(state: dict, options: CommOptions) -> None:
    saved = {k: state["comm"].get(k) for k in WIRE_FIELDS}
    mine = {k: getattr(options, k) for k in WIRE_FIELDS}
    if saved != mine:
        raise ValueError(f"checkpoint was saved with communication options {saved}, "
                         f"this optimizer has {mine}")


def _survivor_of(state: dict, lost: list[int], world: int, ppn: int, rank: int) -> bool:
    """Whether this run is the saved run's survivors (its nodes but the ``lost`` ones, in
    order, same ranks per node) and this rank holds the saved rank's place among them."""
    if state["procs_per_node"] != ppn or state["world_size"] - len(lost) * ppn != world:
        return False
    live = [n for n in range(state["world_size"] // ppn) if n not in lost]
    node, local = divmod(state["rank"], ppn)
    return node in live and live.index(node) == rank // ppn and local == rank % ppn


def check_loadable(state: object, options: CommOptions, topology: Topology | None, *,
                   on_world_size_change: str = "error", warn: bool = True) -> bool:
    """Validate a saved engine entry against this run; changes nothing.

    Returns:
        True when the gossip and intra-node state load as they are (same geometry), False when
        they restart (``on_world_size_change="reinit"`` across a geometry change; warned).

    Raises:
        ValueError: a malformed entry, another rank's entry, different wire options, or a
            geometry change under ``"error"`` (both world sizes named).
    """
    check_choice("on_world_size_change", on_world_size_change, WORLD_CHANGE_MODES)
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        raise ValueError(f"the 'qcomm' entry is not a qcomm engine state of format "
                         f"{READABLE_FORMATS}")
    world, ppn, rank = geometry(options.procs_per_node, topology)
    same = state["world_size"] == world and state["procs_per_node"] == ppn
    lost = (state.get("gossip") or {}).get("lost") or []
    if not same and lost and on_world_size_change == "error" \
            and _survivor_of(state, lost, world, ppn, rank):
        _check_wire(state, options)
        return True   # the survivors' own run, restarted without the lost nodes: exact
    if same and lost:
        if on_world_size_change == "error":
            raise ValueError(
                f"checkpoint was saved after gossip neighbours were lost (members {lost} of "
                "its rail): its gossip links are not this run's graph; pass "
                "on_world_size_change='reinit' to keep the parameters and optimizer state and "
                "restart the gossip state")
        same = False
        change = f"gossip neighbours were lost (members {lost} of its rail)"
    else:
        change = f"world size changed from {state['world_size']} to {world}"
    if not same and on_world_size_change == "error":
        raise ValueError(
            f"checkpoint was saved with world size {state['world_size']} "
            f"({state['procs_per_node']} ranks per node) but this run has world size "
            f"{world} ({ppn} ranks per node); pass on_world_size_change='reinit' to "
            "keep the optimizer state and restart the gossip state"
        )
    if same:
        if state["rank"] != rank:
            raise ValueError(f"checkpoint belongs to rank {state['rank']}, this is rank {rank}")
        _check_wire(state, options)
        return True
    if _nonzero_residuals(state["intra"]):
        raise ValueError(
            f"checkpoint was saved with world size {state['world_size']}, this run has "
            f"world size {world}, and {change}: the intra_bits error-feedback residuals are "
            "laid out for the old node and cannot be carried over"
        )
    if warn and state["gossip"] is not None:
        warnings.warn(
            f"{change}: the gossip state "
            "is re-initialized (CHOCO's residual x - x_hat lives in the parameters, "
            "and dropped mixing corrections sum to zero over nodes, so the global "
            "mean of the parameters is preserved)", stacklevel=4,
        )
    return False
