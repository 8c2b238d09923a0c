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
for that state (``timeout_s``), starts from it and links to its neighbours. The wrapped
optimizer's state (momentum, Adam's moments and step counts) comes with it
(``join_optimizer_state="copy"``, the default; its hyperparameters stay the joiner's own) or
starts fresh (``"fresh"``: the join moves less; parameters FSDP2 shards always start fresh).

A node of several ranks joins on every rail at once: local rank l takes rail l's neighbour's
state. Those neighbours answer when their own watchers see the join, so their steps may differ
by a few; the node's ranks then agree (one all-reduce over the node) on the latest of those
steps as the node's clock, and each rank keeps the shard it gossips from its own neighbour and
takes the other shards from its node-mates (the node's all-gather), so that the node's ranks
hold one model and one step. No rank applies anything until every rank of the node received its
state: a rank that could not join fails the node's join on every rank, each naming why.

Seats beyond the nodes the job started with are absent until taken: every node starts
linked past them (:func:`~qcomm.collectives.gossip.joining.start_without`).
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from qcomm.collectives.gossip.joining import (
    admit,
    join_state,
    offers_state,
    start_joined,
    start_without,
)
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.topology import Topology
from qcomm.engine.agreement import check_agreement, check_job_agreement
from qcomm.rendezvous.departures import NoRunningMemberError, RunningMembers, leave, returns
from qcomm.rendezvous.joins import JoinWatcher, announce, await_state, offer_state
from qcomm.rendezvous.node import LinkedSeat
from qcomm.rendezvous.refusals import RefusedError, record_refusal
from qcomm.rendezvous.seat import parse_address
from qcomm.rendezvous.start import start_together
from qcomm.rendezvous.threads import fit_threads

__all__ = ["NodeJoins", "agree_and_join", "check_linked_options", "wait_for_links"]

log = logging.getLogger("qcomm")


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when it has none), for a log line."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def wait_for_links(gossip: Any, timeout_s: float, who: str) -> bool:
    """Wait up to ``timeout_s`` for ``gossip``'s links to be made (``wait_linked``); when some
    are not, say so on the ``qcomm`` logger (a warning naming ``who`` and the bound) and go
    on: each such link then ends within its own bounds, and a peer it cannot reach is lost as
    any other. Returns whether all were made."""
    made = gossip.wait_linked(timeout_s)
    if not made:
        log.warning("%s: not every gossip link was made within %g s of the start (the silence "
                    "bound); training goes on, each such link within its own bounds, and a "
                    "peer it never reaches is counted lost", who, timeout_s)
    return made


def check_linked_options(options: Any, seat: LinkedSeat) -> None:
    """Raise ValueError when ``options`` cannot run on linked nodes (named)."""
    # on_peer_loss="continue" is refused by CommOptions without wait_free=True
    if options.on_peer_loss != "continue":
        raise ValueError(
            "nodes linked through the rendezvous (qcomm.rendezvous.init_node) need "
            "wait_free=True and on_peer_loss='continue', got wait_free="
            f"{options.wait_free!r}, on_peer_loss={options.on_peer_loss!r}: their links come "
            "and go while the job runs, and a lockstep round would wait for a node that left")
    if options.procs_per_node not in (None, seat.procs_per_node):
        raise ValueError(f"procs_per_node={options.procs_per_node} but this node runs "
                         f"{seat.procs_per_node} ranks (its torchrun's --nproc-per-node)")


def agree_and_join(seat: LinkedSeat, row: list[int], topology: Topology, node: Any,
                   options: Any, buffers: Any, owner: Any) -> NodeJoins | None:
    """Linked nodes at set-up: agree over the node, then with the job at the rendezvous (a node
    that differs is refused alone); a node that comes back starts from a running neighbour's
    state; watch for the nodes that join after.

    Args:
        seat: this node's seat.
        row: this rank's agreement row (:func:`~qcomm.engine.agreement.fingerprint`).
        topology: the job's layout, groups made.
        node: the rank's :class:`~qcomm.engine.node_gossip.NodeGossip`, None without gossip.
        options: the communication options (``timeout_s``, ``join_optimizer_state``).
        buffers: the attached model's buffers, or None.
        owner: the wrapped optimizer (its state is copied by a join with
            ``join_optimizer_state="copy"``, parameters not sharded).

    Returns:
        The rank's :class:`NodeJoins`, watching; None without gossip.
    """
    check_agreement(row, topology.intra, topology.procs_per_node,
                    topology.control_device(), options.timeout_s)
    store = seat.store()
    try:
        check_job_agreement(row, store, "qcomm/linked/agreement")
    except ValueError as e:
        # Kept at the rendezvous: this node's torchrun restarts are refused before they take
        # a seat, and the nodes waiting to link to it stop waiting.
        record_refusal(store, seat.node, seat.incarnation, str(e))
        raise RefusedError(str(e)) from e
    # Nodes on this machine seated after this one took its seat: share the cores with them too.
    fit_threads(store, seat.nodes, seat.node)
    if node is None:
        return None
    copies = options.join_optimizer_state == "copy" and not node.sharded
    joins = NodeJoins(seat, node, buffers, owner if copies else None)
    try:
        if seat.joining:
            joins.join()
        else:
            joins.start_without_absent()
        joins.watch()
    except BaseException:
        joins.close()
        raise
    return joins


class NodeJoins:
    """One rank's part in joins on its rail (module docstring).

    Args:
        seat: this node's seat.
        node: the rank's :class:`~qcomm.engine.node_gossip.NodeGossip` (wait-free).
        buffers: the attached model's buffers (:class:`~qcomm.engine.buffers.ModelBuffers`),
            or None.
        optimizer: the wrapped torch optimizer whose state a join copies, or None (it
            starts fresh).
    """

    def __init__(self, seat: LinkedSeat, node: Any, buffers: Any = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.seat, self.node, self.buffers, self.optimizer = seat, node, buffers, optimizer
        self.prefix = f"qcomm/linked/rail{seat.local_rank}/"
        self._client = seat.store()
        self.store = torch.distributed.PrefixStore(self.prefix, self._client)
        self._watcher: JoinWatcher | None = None
        self._seen = 0
        # an optimizer of this process that closed before said this rank left: it is back
        returns(self.store, seat.node, seat.incarnation)

    # -----------------------------------------------------------------------------------------
    # the node that joins

    def join(self) -> None:
        """Announce this node's join, wait for a running neighbour's state, start from it (the
        parameters this rank gossips, its gossip, the buffers). Before the first round.

        Collective over the node's ranks when it has several (module docstring).

        Raises:
            TimeoutError: no running node offered a state within ``timeout_s``.
            NoRunningMemberError: no other member is left to offer one (each left, was
                refused, never took its seat or went silent: the job ended), found within
                a few seconds.
            ValueError: the running nodes' gossip or model differ from this one's (named);
                nothing of this rank changed.
            RuntimeError: another rank of this node could not join; nothing of this rank
                changed.
        """
        seat = self.seat
        seq = announce(self.store, seat.node, seat.incarnation)
        log.info("qcomm: node %d (incarnation %d) joins the running job (join %d)", seat.node,
                 seat.incarnation, seq)
        state, failure = None, None
        try:
            state = self._received(seq)
        except (TimeoutError, ValueError, NoRunningMemberError) as e:
            failure = e
        others_failed = bool(self._node_max(int(failure is not None)))
        if failure is not None:
            raise failure
        if others_failed:
            raise RuntimeError(f"node {seat.node} could not join the running job: another of "
                               "its ranks received no state from its rail (its error says why)")
        flat = self.node.flat
        if self.buffers is not None and state.get("buffers") is not None:
            self.buffers.load(state["buffers"])
        start_joined(self.node.gossip, state["gossip"], flat.flat.device)
        flat.check_aliased()
        flat.flat.copy_(state["x"])
        flat.store_to_params()
        if self.optimizer is not None and state.get("optimizer") is not None:
            mine = self.optimizer.state_dict()   # its hyperparameters stay this node's
            self.optimizer.load_state_dict({**mine, "state": state["optimizer"]})
        self._one_node()
        self._seen = seq
        log.info("qcomm: node %d joined at step %d from a running neighbour's state", seat.node,
                 self.node.gossip.steps)

    def _token(self) -> bytes | None:
        """The job token the state a joiner takes is sealed with (None: none)."""
        return None if self.seat.token is None else self.seat.token.encode()

    def _received(self, seq: int) -> dict:
        """The state a running neighbour offered to join ``seq``, checked against this rank's
        model."""
        seat = self.seat
        others = {m: m * seat.procs_per_node + seat.local_rank for m in range(seat.nodes)
                  if m != seat.node}
        running = RunningMembers(self._client, self.store, others, seat.timeout_s)
        payload = await_state(self.store, seq, seat.timeout_s, seat.rendezvous,
                              token=self._token(), check=running.check)
        state = torch.load(io.BytesIO(payload), weights_only=True)
        x, flat = state["x"], self.node.flat
        if x.shape != flat.flat.shape:
            raise ValueError(f"the running nodes gossip {tuple(x.shape)} elements and this node "
                             f"{tuple(flat.flat.shape)}: not the same model")
        return state

    def _node_max(self, value: int) -> int:
        """The largest ``value`` of this node's ranks (collective over the node; alone: its
        own)."""
        topo = self.node.topology
        if topo.procs_per_node == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=topo.control_device())
        all_reduce(t, topo.intra, "max", timeout_s=self.seat.timeout_s, link="intra",
                   operation="join")
        return int(t.item())

    def _one_node(self) -> None:
        """The node's ranks, each started from its own rail's neighbour, agree on one clock
        (the latest) and one model (shard l from local rank l). Collective over the node."""
        topo, g = self.node.topology, self.node.gossip
        if topo.procs_per_node == 1:
            return
        steps = self._node_max(g.steps)
        if steps != g.steps:
            log.info("qcomm: rank %d of joining node %d moves its clock from step %d to the "
                     "node's %d", topo.rank, self.seat.node, g.steps, steps)
            g.restart_clock(steps)
        self.node.share_own_shard()
        if self.optimizer is not None:
            self._node_takes_optimizer_state_of_local_rank_0()

    def _node_takes_optimizer_state_of_local_rank_0(self) -> None:
        """Every rank's optimizer state <- local rank 0's (it came from rail 0's neighbour; the
        others' from theirs, a few steps apart): one sum per value over the node, to which
        only local rank 0 adds anything, so every rank holds its bits."""
        topo, opt = self.node.topology, self.optimizer
        first = topo.local_rank == 0
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p, {})
                for key in sorted(st):
                    value = st[key]
                    if isinstance(value, torch.Tensor):
                        t = value if first else torch.zeros_like(value)
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        t = torch.tensor([float(value) if first else 0.0], dtype=torch.float64)
                    else:
                        continue
                    all_reduce(t, topo.intra, "sum", timeout_s=self.seat.timeout_s,
                               link="intra", operation="join")
                    if isinstance(value, torch.Tensor):
                        if not first:
                            value.copy_(t)
                    else:
                        st[key] = type(value)(t.item())

    # -----------------------------------------------------------------------------------------
    # the running nodes

    def start_without_absent(self) -> None:
        """A node of the job's start: wait for the other starting nodes to set up
        (:func:`~qcomm.rendezvous.start.start_together`) and for its links to be made, link
        past the seats not taken yet (before its first round)."""
        seat = self.seat
        ppn = seat.procs_per_node
        start_together(self._client, seat.node, seat.starting, rail=f"rail{seat.local_rank}",
                       ranks=[m * ppn + seat.local_rank for m in range(seat.nodes)],
                       join_timeout_s=seat.join_timeout_s, silence_s=seat.timeout_s,
                       where=seat.rendezvous, who=f"rank {seat.rank} (rail{seat.local_rank})")
        if seat.starting < seat.nodes:
            start_without(self.node.gossip, set(range(seat.starting, seat.nodes)))
        # and with their links made: one still being made when its backlog fills holds the
        # step, and is then taken for a silent peer. Up to the silence bound: a link that
        # takes longer is left to its own bounds (a peer that set up and died meanwhile).
        wait_for_links(self.node.gossip, seat.timeout_s, f"rank {seat.rank}")

    def watch(self) -> None:
        """Start watching the rendezvous for joins after this rank's own (idempotent)."""
        if self._watcher is None:
            host, port = parse_address(self.seat.rendezvous)
            self._watcher = JoinWatcher(host, port, seen=self._seen, prefix=self.prefix)
            # a neighbour that retires its link to this rank for a joiner not seen yet (this
            # rank between steps, in a drain or the final average): look now
            if not self.node.gossip.time_varying:   # the ring's retire protocol only
                self.node.gossip.membership.on_unknown_join = self.admit_now

    def admit_now(self) -> None:
        """:meth:`admit_new` after a poll of the rendezvous in this thread."""
        if self._watcher is not None:
            self._watcher.poll_now()
        self.admit_new()

    def admit_new(self) -> None:
        """Admit the members that announced a join since the last call; offer the state to the
        ones this rank offers to (:func:`~qcomm.collectives.gossip.joining.offers_state`: the
        nearest live member below on a static graph, every peer on the one-peer graph). Before
        the step's round."""
        if self._watcher is None:
            return
        g = self.node.gossip
        for seq, member, incarnation in self._watcher.new():
            if member == self.seat.node:
                continue
            admit(g, member)
            if offers_state(g, member) and g.rounds_started:
                try:
                    offer_state(self.store, seq, self._payload(), token=self._token())
                except RuntimeError as e:   # the rendezvous: down, or it dropped us
                    # The running node trains on; the joiner, without a state, fails its join
                    # in its own bound, and its link here counts as lost like any other.
                    log.warning("qcomm: node %d could not offer its state to node %d "
                                "(incarnation %d): %s", self.seat.node, member, incarnation,
                                _first_line(e))
                    continue
                log.info("qcomm: node %d offered its state to node %d (incarnation %d) at step "
                         "%d", self.seat.node, member, incarnation, g.steps)

    def _payload(self) -> bytes:
        flat = self.node.flat
        flat.check_aliased()
        x = flat.load_from_params().detach().to("cpu", torch.float32, copy=True)
        buffers = self.buffers.values() if self.buffers is not None else None
        optimizer = self.optimizer.state_dict()["state"] if self.optimizer is not None else None
        out = io.BytesIO()
        torch.save({"x": x, "gossip": join_state(self.node.gossip), "buffers": buffers,
                    "optimizer": optimizer}, out)
        return out.getvalue()

    def close(self) -> None:
        """Stop watching (its thread and connection go), and say at the rendezvous that this
        rank left: a node that joins after every member left stops waiting for a state at
        once (:mod:`~qcomm.rendezvous.departures`)."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        try:
            leave(self.store, self.seat.node, self.seat.incarnation)
        except (RuntimeError, OSError) as e:
            # The rendezvous is gone or dropped us: a joiner then finds this rank by its
            # silent beat instead, after the silence bound.
            log.info("qcomm: node %d could not say at the rendezvous that it left (%s)",
                     self.seat.node, _first_line(e))
