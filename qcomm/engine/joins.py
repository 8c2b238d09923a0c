"""Nodes that come back to a running job, as the optimizers see them: the node that joins starts
from a running neighbour's state, the running ones let it in without stopping.

Only for nodes linked through the rendezvous (:func:`qcomm.rendezvous.init_node`). Each rank
watches its rail's joins at the rendezvous (:class:`~qcomm.rendezvous.joins.JoinWatcher`, a
thread of its own). At each step, before the round, a running rank admits the members that
announced a join (:func:`~qcomm.collectives.gossip.joining.admit`: the ring opens to them next to
them) and, when it is the joiner's nearest live member below, offers it its state: its
parameters (the shard it gossips), its gossip's join state and the attached model's buffers. A
node that comes back (its seat's incarnation above 1) or that takes a seat beyond the nodes the
job started with announces itself at its first step, waits
for that state (``timeout_s``), starts from it and links to its neighbours. The optimizer's own
state (momentum, Adam's moments) starts fresh on the joiner: it is its own, rebuilt in a few
steps.

A node of several ranks cannot join a running job yet: its rails would take their neighbours'
states at different steps, and the node's ranks must hold one step. It is refused with a named
error. Seats beyond the nodes the job started with are absent until taken: every node starts
linked past them (:func:`~qcomm.collectives.gossip.joining.start_without`).
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from qcomm.collectives.gossip.joining import admit, join_state, start_joined, start_without
from qcomm.rendezvous.joins import JoinWatcher, announce, await_state, offer_state
from qcomm.rendezvous.node import LinkedSeat
from qcomm.rendezvous.seat import parse_address

__all__ = ["NodeJoins", "check_linked_options"]

log = logging.getLogger("qcomm")


def check_linked_options(options: Any, seat: LinkedSeat) -> None:
    """Raise ValueError when ``options`` cannot run on linked nodes (named)."""
    if not (options.wait_free and options.on_peer_loss == "continue"):
        raise ValueError(
            "nodes linked through the rendezvous (qcomm.rendezvous.init_node) need "
            "wait_free=True and on_peer_loss='continue', got wait_free="
            f"{options.wait_free!r}, on_peer_loss={options.on_peer_loss!r}: their links come "
            "and go while the job runs, and a lockstep round would wait for a node that left")
    if options.procs_per_node not in (None, seat.procs_per_node):
        raise ValueError(f"procs_per_node={options.procs_per_node} but this node runs "
                         f"{seat.procs_per_node} ranks (its torchrun's --nproc-per-node)")
    if seat.joining and seat.procs_per_node > 1:
        raise ValueError(
            f"node {seat.node} joins the running job with {seat.procs_per_node} ranks: a node "
            "of several ranks cannot join a running job yet (its ranks would start from "
            "different steps); restart the job from a checkpoint, or run one rank per node")


class NodeJoins:
    """One rank's part in joins on its rail (module docstring).

    Args:
        seat: this node's seat.
        node: the rank's :class:`~qcomm.engine.node_gossip.NodeGossip` (wait-free).
        buffers: the attached model's buffers (:class:`~qcomm.engine.buffers.ModelBuffers`),
            or None.
    """

    def __init__(self, seat: LinkedSeat, node: Any, buffers: Any = None) -> None:
        self.seat, self.node, self.buffers = seat, node, buffers
        self.prefix = f"qcomm/linked/rail{seat.local_rank}/"
        self._client = seat.store()
        self.store = torch.distributed.PrefixStore(self.prefix, self._client)
        self._watcher: JoinWatcher | None = None
        self._seen = 0

    # -----------------------------------------------------------------------------------------
    # the node that joins

    def join(self) -> None:
        """Announce this node's join, wait for a running neighbour's state, start from it (the
        parameters this rank gossips, its gossip, the buffers). Before the first round.

        Raises:
            TimeoutError: no running node offered a state within ``timeout_s``.
            ValueError: the running nodes' gossip or model differ from this one's (named);
                nothing of this rank changed.
        """
        seat = self.seat
        seq = announce(self.store, seat.node, seat.incarnation)
        log.info("qcomm: node %d (incarnation %d) joins the running job (join %d)", seat.node,
                 seat.incarnation, seq)
        payload = await_state(self.store, seq, seat.timeout_s)
        state = torch.load(io.BytesIO(payload), weights_only=True)
        flat = self.node.flat
        x = state["x"]
        if x.shape != flat.flat.shape:
            raise ValueError(f"the running nodes gossip {tuple(x.shape)} elements and this node "
                             f"{tuple(flat.flat.shape)}: not the same model")
        if self.buffers is not None and state.get("buffers") is not None:
            self.buffers.load(state["buffers"])
        start_joined(self.node.gossip, state["gossip"], flat.flat.device)
        flat.check_aliased()
        flat.flat.copy_(x)
        flat.store_to_params()
        self._seen = seq
        log.info("qcomm: node %d joined at step %d from a running neighbour's state", seat.node,
                 self.node.gossip.steps)

    # -----------------------------------------------------------------------------------------
    # the running nodes

    def start_without_absent(self) -> None:
        """A node of the job's start: link past the seats not taken yet (before its first
        round)."""
        seat = self.seat
        if seat.starting < seat.nodes:
            start_without(self.node.gossip, set(range(seat.starting, seat.nodes)))

    def watch(self) -> None:
        """Start watching the rendezvous for joins after this rank's own (idempotent)."""
        if self._watcher is None:
            host, port = parse_address(self.seat.rendezvous)
            self._watcher = JoinWatcher(host, port, seen=self._seen, prefix=self.prefix)
            # a neighbour that retires its link to this rank for a joiner not seen yet (this
            # rank between steps, in a drain or the final average): look now
            self.node.gossip.membership.on_unknown_join = self.admit_now

    def admit_now(self) -> None:
        """:meth:`admit_new` after a poll of the rendezvous in this thread."""
        if self._watcher is not None:
            self._watcher.poll_now()
        self.admit_new()

    def admit_new(self) -> None:
        """Admit the members that announced a join since the last call; offer the state to the
        ones this rank is the nearest live member below of. Before the step's round."""
        if self._watcher is None:
            return
        g = self.node.gossip
        for seq, member, incarnation in self._watcher.new():
            if member == self.seat.node:
                continue
            admit(g, member)
            if g.membership.nearest_live(1) == member and g.rounds_started:
                offer_state(self.store, seq, self._payload())
                log.info("qcomm: node %d offered its state to node %d (incarnation %d) at step "
                         "%d", self.seat.node, member, incarnation, g.steps)

    def _payload(self) -> bytes:
        flat = self.node.flat
        flat.check_aliased()
        x = flat.load_from_params().detach().to("cpu", torch.float32, copy=True)
        buffers = self.buffers.values() if self.buffers is not None else None
        out = io.BytesIO()
        torch.save({"x": x, "gossip": join_state(self.node.gossip), "buffers": buffers}, out)
        return out.getvalue()

    def close(self) -> None:
        """Stop watching (its thread and connection go)."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
