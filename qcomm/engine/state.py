"""The engine's checkpoint entry: what it holds, whether a saved one may be loaded here, and
:class:`EngineState`, which saves it and loads it for the engine.

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
from typing import TYPE_CHECKING, Any

from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.graph_choice import choose_graph
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.engine.options import WIRE_FIELDS, CommOptions
from qcomm.engine.placement import geometry
from qcomm.validation import check_choice

if TYPE_CHECKING:   # (they import this module)
    from qcomm.engine.placement import Placement
    from qcomm.engine.runtime import Runtime
    from qcomm.engine.step import StepCycle

__all__ = ["STATE_FORMAT", "WORLD_CHANGE_MODES", "EngineState", "EngineStateFile",
           "check_loadable", "geometry"]

STATE_FORMAT = 2
READABLE_FORMATS = (STATE_FORMAT,)
WORLD_CHANGE_MODES = ("error", "reinit")


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


def _check_wire(state: dict, options: CommOptions, num_nodes: int) -> None:
    """Raise ValueError unless ``state`` was saved with this run's wire options; the graph
    compared is the one each run gossips over (``graph=None`` chooses it by the node count:
    the saved run's count for the saved one, ``num_nodes`` for this one)."""
    comm = state["comm"]
    saved = {k: comm.get(k) for k in WIRE_FIELDS}
    mine = {k: getattr(options, k) for k in WIRE_FIELDS}
    saved_nodes = max(1, state["world_size"] // state["procs_per_node"])
    saved["graph"] = choose_graph(comm.get("graph"), saved_nodes)[0]
    mine["graph"] = options.chosen_graph(num_nodes)[0]
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
                   on_world_size_change: str = "error", warn: bool = True,
                   stacklevel: int = 4) -> bool:
    """Validate a saved engine entry against this run; changes nothing.

    ``stacklevel``: the warning's, seen from here (the engine passes its caller's).

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
        _check_wire(state, options, max(1, world // ppn))
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
        _check_wire(state, options, max(1, world // ppn))
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
            "mean of the parameters is preserved)", stacklevel=stacklevel,
        )
    return False


class EngineState:
    """The engine's checkpoint room: its entry saved from the live objects (or from what waits
    for them), loaded into them now, or at the first distributed step when they are not built
    yet (``pending``).

    Args:
        options: the communication options.
        placement: where this rank runs (its geometry, without a collective).
    """

    def __init__(self, options: CommOptions, placement: Placement) -> None:
        self.options, self.placement = options, placement
        self.pending: dict[str, Any] | None = None   # loaded, waiting for the first step

    def save(self, runtime: Runtime | None, clock: StepClock, skipped_steps: int,
             comm_stats: CommStats) -> dict[str, Any]:
        """The entry (module docstring); the gossip's part first (a drain, with the wait-free
        gossip: collective over the rail), then the counters."""
        pending = self.pending or {}
        node = runtime.node if runtime is not None else None
        intra = runtime.intra if runtime is not None else None
        gossip = node.state() if node is not None else pending.get("gossip")
        intra_state = intra.state_dict() if intra is not None else pending.get("intra")
        return EngineStateFile.build(
            self.placement.geometry(), steps=clock.steps, skipped_steps=skipped_steps,
            options=self.options, gossip=gossip, intra=intra_state,
            comm_stats=comm_stats.snapshot())

    def load(self, state: dict[str, Any], runtime: Runtime | None, clock: StepClock,
             step: StepCycle, comm_stats: CommStats, on_world_size_change: str) -> None:
        """Load an entry: validated first (:func:`check_loadable`), then the counters, the
        parts whose objects exist, and the rest kept for :meth:`apply_pending`."""
        keep = check_loadable(state, self.options, self.placement.given,
                              on_world_size_change=on_world_size_change,
                              stacklevel=5)   # the caller of the engine's load_state_dict
        steps = int(state["steps"])
        step.skipped_steps = int(state["skipped_steps"])
        if "comm_stats" in state:
            comm_stats.load(state["comm_stats"])
        gossip_state = state["gossip"] if keep else None
        intra_state = state["intra"] if keep else None
        node = runtime.node if runtime is not None else None
        intra = runtime.intra if runtime is not None else None
        if node is not None and gossip_state is not None:
            node.gossip.load_state_dict(gossip_state)   # its clock with it (the mode's own)
            gossip_state = None
        else:
            # without a gossip state (one node, the gossip not built yet, or a fresh one after
            # on_world_size_change="reinit") the clock goes on counting from here
            clock.restart(steps)
        if intra is not None and intra_state is not None:
            intra.load_state_dict(intra_state)
            intra_state = None
        self.pending = {"gossip": gossip_state, "intra": intra_state}

    def apply_pending(self, runtime: Runtime) -> None:
        """At the first distributed step, once ``runtime`` is built: load what waited for it
        (a node that joined started from a running neighbour's state, not its checkpoint's)."""
        pending = self.pending
        if pending is None:
            return
        if self.placement.joining:
            pending["gossip"] = None
        if runtime.intra is not None and pending.get("intra") is not None:
            runtime.intra.load_state_dict(pending["intra"])
        if runtime.node is not None and pending.get("gossip") is not None:
            runtime.node.gossip.load_state_dict(pending["gossip"])
        self.pending = None

    def check(self, state: dict[str, Any], on_world_size_change: str) -> None:
        """Raise what :meth:`load` would raise, changing nothing."""
        check_loadable(state, self.options, self.placement.given,
                       on_world_size_change=on_world_size_change, warn=False)
