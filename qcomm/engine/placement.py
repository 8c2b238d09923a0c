"""Where this rank runs, known without any collective: the topology given (or the linked seat's),
the world size, the geometry, and whether the parameters are FSDP2 shards.

The engine asks it before anything is built (is there anyone to talk to?) and at the first
distributed step (which topology to build the groups on). Nodes linked through the rendezvous
(:func:`qcomm.rendezvous.init_node`) take the seat's topology, its rails groups of two made as
links open.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist

from qcomm.collectives.linked_world import LinkedWorld
from qcomm.collectives.topology import Topology
from qcomm.engine.options import CommOptions
from qcomm.engine.sharded import check_sharding
from qcomm.rendezvous.node import LinkedSeat, linked_seat, with_options

__all__ = ["Placement", "check_not_differentiable", "geometry"]


def geometry(procs_per_node: int | None, topology: Topology | None) -> tuple[int, int, int]:
    """(world size, ranks per node, rank) of this run, without any collective."""
    if topology is not None:
        return topology.world_size, topology.procs_per_node, topology.rank
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 1, 1, 0
    topo = Topology(procs_per_node)
    return topo.world_size, topo.procs_per_node, topo.rank


def check_not_differentiable(groups: list[dict[str, Any]]) -> None:
    """ValueError naming the first param group with ``differentiable=True``."""
    for gi, group in enumerate(groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"differentiable=True (param group {gi}) is supported in a single process "
                "only: the node's gradient mean and the gossip between nodes are not "
                "differentiable; pass differentiable=False")


class Placement:
    """This rank's place in the job (module docstring).

    Args:
        options: the communication options (``procs_per_node``).
        topology: the topology given to the engine; None: the linked seat's when this process
            runs a linked node (``linked=True``), else torch.distributed's, built when needed.
        linked: look for a linked seat when ``topology`` is None (False: an unpickled engine,
            whose seat is not the pickled one's).
    """

    def __init__(self, options: CommOptions, topology: Topology | None, *,
                 linked: bool = True) -> None:
        self.options = options
        self.linked: LinkedSeat | None = linked_seat() if topology is None and linked else None
        if self.linked is not None:   # the options' port and token over init_node's
            self.linked = with_options(self.linked, options.listen, options.token)
            seat = self.linked
            topology = Topology(seat.procs_per_node, rank=seat.rank,
                                world_size=seat.world_size, world=LinkedWorld(seat))
        self.given = topology
        self._warned_env = False

    @property
    def joining(self) -> bool:
        """Whether this rank's node joins a running job (a linked node that comes back)."""
        return self.linked is not None and self.linked.joining

    def world_size_now(self) -> int | None:
        """The job's world size as known without a collective; None without a topology and
        without a process group."""
        if self.given is not None:
            return self.given.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return None

    @property
    def distributed(self) -> bool:
        """True when this rank has peers (warned once when the environment says so and no
        process group exists)."""
        world = self.world_size_now()
        if world is None:
            self._warn_env_without_group()
            return False
        return world > 1

    def _warn_env_without_group(self) -> None:
        if self._warned_env:
            return
        raw = os.environ.get("WORLD_SIZE", "")
        if raw.strip().isdigit() and int(raw) > 1:
            self._warned_env = True
            warnings.warn(
                f"WORLD_SIZE={raw} is set but torch.distributed is not initialized, so this "
                "process trains alone (no gradient averaging, no gossip). Call "
                "torch.distributed.init_process_group() before the first step.",
                # the engine's caller: past this frame, distributed, and the engine's two (its
                # property and the caller's, or its method and the helper it calls)
                RuntimeWarning, stacklevel=5,
            )

    def topology(self) -> Topology:
        """The topology to build the groups on (the given one, or torch.distributed's)."""
        return self.given or Topology(self.options.procs_per_node)

    def geometry(self) -> tuple[int, int, int]:
        """(world size, ranks per node, rank), without any collective."""
        return geometry(self.options.procs_per_node, self.given)

    def sharding(self, groups: list[dict[str, Any]], topology: Topology | None = None) -> bool:
        """Whether the parameters of ``groups`` are FSDP2 shards of this node's ranks
        (:func:`~qcomm.engine.sharded.check_sharding`, which raises for any other kind)."""
        return check_sharding(groups, self.options, lambda: topology or self.topology())

    def check_groups(self, groups: list[dict[str, Any]], owned: list[dict[str, Any]]) -> None:
        """Raise ValueError when this rank has peers and a group of ``groups`` asks for
        ``differentiable=True``; check the sharding of ``groups`` with the optimizer's
        ``owned`` ones in any process."""
        world = self.world_size_now()
        if world is not None and world > 1:
            check_not_differentiable(groups)
        self.sharding([*owned, *(g for g in groups if not any(g is o for o in owned))])
