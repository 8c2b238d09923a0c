"""What the engine builds at the first distributed step and holds until it closes: the topology
with its process groups, the node's allreduce, the gossip between nodes, the joins (linked
nodes), and what runs over them outside a step (the exact average, the flush, the close).

Building it is collective (every rank at the same point): the groups are made, then one small
collective checks that every rank has the same options and communicated parameters
(:mod:`qcomm.engine.agreement`) before anything is exchanged. Everything a run cannot carry out
is refused before the first group is made, while nothing has changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.member import GossipMember
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.engine.agreement import check_agreement, fingerprint
from qcomm.engine.attachment import Attachment, check_fused_devices
from qcomm.engine.buffers import ModelBuffers
from qcomm.engine.joins import NodeJoins, agree_and_join, check_linked_options
from qcomm.engine.node_gossip import NodeGossip
from qcomm.engine.options import CommOptions
from qcomm.engine.placement import Placement, check_not_differentiable

__all__ = ["Runtime", "build_runtime"]


@dataclass
class Runtime:
    """The communication objects of one set-up (module docstring).

    Attributes:
        topology: the job's layout, its groups made.
        intra: the node's allreduce, None alone on the node.
        node: the gossip between nodes, None on one node (or with every parameter frozen).
        joins: the joins on this rank's rail (linked nodes), else None.
        frozen: the optimizer's parameters that did not require a gradient at set-up.
        sharded: the parameters are FSDP2 shards of the node's ranks.
    """

    topology: Topology
    intra: IntraNodeAllreduce | None
    node: NodeGossip | None
    joins: NodeJoins | None
    frozen: list[torch.Tensor]
    sharded: bool

    @property
    def gossip(self) -> GossipMember | None:
        """The gossip member (None without gossip)."""
        return self.node.gossip if self.node is not None else None

    @torch.no_grad()
    def average(self, buffers: ModelBuffers | None, timeout_s: float) -> None:
        """Every rank's communicated parameters, and the attached model's ``buffers``, to their
        exact mean over the (live) nodes (collective; see
        :meth:`qcomm.engine.AveragingEngine.average_parameters`)."""
        if self.node is not None:
            self.node.average()
        # else: synchronous data parallel, the ranks hold the same parameters already
        if buffers is not None:
            nodes = None
            if self.node is not None:
                nodes = self.node.reduce_over_nodes
            elif self.topology.num_nodes > 1:   # nothing gossiped (every parameter frozen)
                nodes = lambda flat, op: self._rail_reduce(flat, op, timeout_s)
            buffers.average(self.topology.intra, self.topology.procs_per_node, timeout_s,
                            nodes)

    def _rail_reduce(self, flat: torch.Tensor, op: str,
                     timeout_s: float) -> tuple[torch.Tensor, int]:
        """``flat`` reduced over this rank's rail (every node, no gossip to ask for the live
        ones)."""
        all_reduce(flat, self.topology.rail, op, timeout_s=timeout_s, link="inter",
                   operation="average_parameters")
        return flat, self.topology.num_nodes

    def flush(self) -> None:
        """Wait for the gossip rounds in flight and apply them to the public copies."""
        if self.node is not None:
            self.node.gossip.flush()

    def close(self) -> None:
        """End the gossip its mode's way (never raising a peer's failure) and stop watching
        for joins."""
        if self.node is not None:
            self.node.gossip.leave()
        if self.joins is not None:
            self.joins.close()


def build_runtime(options: CommOptions, placement: Placement, attachment: Attachment,
                  stats: CommStats, clock: StepClock) -> Runtime:
    """Make the groups and the communication objects, and agree with the other ranks
    (collective: every rank at the same point).

    Args:
        options: the communication options.
        placement: where this rank runs (the topology to build on, the linked seat).
        attachment: the optimizer's parameters and the attached model.
        stats: where the communication counts its bytes.
        clock: the run's step clock, which the gossip advances.

    Raises:
        ValueError: options or parameters that cannot run here, or that differ between ranks
            (named, on every rank alike); nothing was exchanged.
    """
    groups = attachment.owner.param_groups
    check_not_differentiable(groups)
    check_fused_devices(groups)
    if placement.linked is not None:
        check_linked_options(options, placement.linked)
    topo = placement.topology()
    sharded = placement.sharding(groups, topo)
    # Group creation is collective: every rank touches both properties here, in this order.
    _ = topo.intra
    _ = topo.rail
    intra = None
    if topo.procs_per_node > 1:
        intra = IntraNodeAllreduce(topo, bucket_mb=options.bucket_mb, spec=options.intra_spec,
                                   stats=stats, seed=options.seed, timeout_s=options.timeout_s)
    params = attachment.params()
    communicated = [p for p in params if p.requires_grad]
    node = None
    if topo.num_nodes > 1 and communicated:
        node = NodeGossip(communicated, topo, intra, options, stats, clock, sharded=sharded)
    buffers = attachment.buffers.signature() if attachment.buffers is not None else []
    row = fingerprint(options, communicated, attachment.ddp_intra, buffers, sharded)
    joins = None
    if placement.linked is None:
        check_agreement(row, topo.whole, topo.world_size, topo.control_device(),
                        options.timeout_s)
    else:
        joins = agree_and_join(placement.linked, row, topo, node, options, attachment.buffers,
                               attachment.owner)
    frozen = [p for p in params if not p.requires_grad]
    return Runtime(topo, intra, node, joins, frozen, sharded)
