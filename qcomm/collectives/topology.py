"""Who is on which node: ranks, local ranks, intra-node groups and inter-node rails.

Ranks are laid out node-major, as torchrun does: ``node = rank // procs_per_node`` and
``local_rank = rank % procs_per_node``. A *rail* is the set of ranks that share a local rank, one
per node (``[n * procs_per_node + local_rank for n in range(num_nodes)]``): with one NIC per GPU,
each rail is the path that local rank's traffic takes between nodes.

Rules for the numbers (``Topology()`` with no arguments under torchrun does the right thing):

* ``rank`` / ``world_size``: the explicit argument, else torch.distributed's (when initialized),
  else the ``RANK`` / ``WORLD_SIZE`` environment variables, else ValueError.
* ``procs_per_node``: the explicit argument (so one machine can emulate several nodes; torchrun's
  ``LOCAL_*`` variables are then ignored), else ``LOCAL_WORLD_SIZE`` from torchrun's
  environment (checked against ``LOCAL_RANK``), else 1: every process is its own node, the
  conservative choice (everything between processes is treated as a slow link).

Groups come from the topology's world (:class:`~qcomm.collectives.group.World`):
torch.distributed's process groups unless ``world=`` names another (the in-memory world). The
constructor makes no collective, no blocking call and no ``.cuda()``. The first access to
:attr:`Topology.intra_group` or :attr:`Topology.rail_group` creates ALL groups (every node's
intra group, then every rail), because ``new_group`` is collective over the default group:
every rank must reach that first access at the same point of the program. Process groups are
created with ``backend=None``, i.e. with the default group's backend configuration, so the device
and backend follow the tensors: after ``init_process_group("cpu:gloo,cuda:nccl")`` CPU tensors go
through Gloo and CUDA tensors through NCCL; after ``init_process_group("gloo")`` both go through
Gloo (CUDA tensors staged through host memory).
"""

from __future__ import annotations

import torch

from qcomm.collectives.group import CommGroup, World
from qcomm.collectives.primitives import all_gather_flat
from qcomm.collectives.torch_group import TorchWorld, resolve_group
from qcomm.validation import check_instance, check_int, env_int

__all__ = ["Topology"]

# The world of a Topology built without one: the job torch.distributed runs.
TORCH_WORLD = TorchWorld()


class Topology:
    """How the job's ranks map to nodes (its topology), and its intra-node and rail groups.

    Args:
        procs_per_node: ranks per node (int >= 1 dividing ``world_size``); None reads
            ``LOCAL_WORLD_SIZE`` (torchrun), else 1. See the module docstring for the rules.
        rank: this process's global rank; default torch.distributed's, else ``RANK``.
        world_size: number of processes; default torch.distributed's, else ``WORLD_SIZE``.
        world: where the groups come from (:class:`~qcomm.collectives.group.World`); None:
            torch.distributed (its process groups). An in-memory world
            (:mod:`qcomm.collectives.memory`) runs the job's ranks as threads of one process;
            it needs ``rank`` and ``world_size`` given.

    Attributes:
        rank, world_size, procs_per_node, num_nodes, node, local_rank: ints.
        node_ranks: global ranks on my node, by local rank.
        rail_ranks: global ranks with my local rank, by node.

    Raises:
        TypeError, ValueError: a bad argument or environment variable (named in the message),
            e.g. ``world_size`` not divisible by ``procs_per_node``.
    """

    def __init__(self, procs_per_node: int | None = None, *, rank: int | None = None,
                 world_size: int | None = None, world: World | None = None) -> None:
        world = check_instance("world", world, World, allow_none=True,
                               what="a qcomm.collectives.group.World")
        rank, world_size = (world or TORCH_WORLD).job(rank, world_size)
        if world_size is None:
            raise ValueError("world_size is unknown: pass world_size=, initialize "
                             "torch.distributed, or set WORLD_SIZE")
        world_size = check_int("world_size", world_size, low=1)
        if rank is None:
            raise ValueError("rank is unknown: pass rank=, initialize torch.distributed, "
                             "or set RANK")
        rank = check_int("rank", rank, low=0, high=world_size, high_open=True,
                         what=f"an int in [0, world_size={world_size})")

        if procs_per_node is None:
            procs_per_node = self._procs_per_node_from_env(rank)
        procs_per_node = check_int("procs_per_node", procs_per_node, low=1)
        if world_size % procs_per_node:
            raise ValueError(
                f"every node must have the same number of ranks: world_size={world_size} is not "
                f"divisible by procs_per_node={procs_per_node}"
            )

        self.rank = rank
        self.world_size = world_size
        self.procs_per_node = procs_per_node
        self.num_nodes = world_size // procs_per_node
        self.node = rank // procs_per_node
        self.local_rank = rank % procs_per_node
        self.node_ranks = self.ranks_of_node(self.node)
        self.rail_ranks = self.ranks_of_rail(self.local_rank)
        self._world = world
        # (intra_group, rail_group) once created; None until the first access.
        self._groups: tuple[object, object] | None = None
        # The same as CommGroups (:attr:`intra`, :attr:`rail`), resolved once for every caller.
        self._resolved: tuple[CommGroup | None, CommGroup | None] | None = None

    @staticmethod
    def _procs_per_node_from_env(rank: int) -> int:
        local_world = env_int("LOCAL_WORLD_SIZE", 1)
        if local_world is None:
            return 1
        local_rank = env_int("LOCAL_RANK", 0)
        if local_rank is not None:
            if local_rank >= local_world:
                raise ValueError(f"environment variable LOCAL_RANK={local_rank} must be < "
                                 f"LOCAL_WORLD_SIZE={local_world}")
            # Node-major layout is what every formula here relies on; torchrun guarantees it
            # only when all nodes run the same number of processes.
            if rank % local_world != local_rank:
                raise ValueError(
                    f"LOCAL_RANK={local_rank} is not rank % LOCAL_WORLD_SIZE = {rank} % "
                    f"{local_world}: ranks are not laid out node-major with the same number of "
                    f"processes per node; pass procs_per_node= explicitly"
                )
        return local_world

    # -----------------------------------------------------------------------------------------
    # pure topology queries (no communication)

    def ranks_of_node(self, node: int) -> list[int]:
        """Global ranks on ``node``, by local rank."""
        node = check_int("node", node, low=0, high=self.num_nodes, high_open=True)
        start = node * self.procs_per_node
        return list(range(start, start + self.procs_per_node))

    def ranks_of_rail(self, local_rank: int) -> list[int]:
        """Global ranks with local rank ``local_rank``, by node."""
        local_rank = check_int("local_rank", local_rank, low=0, high=self.procs_per_node,
                               high_open=True)
        return [n * self.procs_per_node + local_rank for n in range(self.num_nodes)]

    def rail_rank(self, node: int) -> int:
        """Global rank of my rail's member on ``node``."""
        node = check_int("node", node, low=0, high=self.num_nodes, high_open=True)
        return node * self.procs_per_node + self.local_rank

    # -----------------------------------------------------------------------------------------
    # process groups

    @property
    def world(self) -> World:
        """Where the groups come from: the ``world=`` given, else torch.distributed's job."""
        return self._world or TORCH_WORLD

    def check_world(self) -> None:
        """Raise RuntimeError unless the world runs the job this topology describes (for
        torch.distributed: it is initialized with this rank and world size; a single-process
        topology needs no process group at all)."""
        self.world.check(self.rank, self.world_size)

    @property
    def world_group(self) -> object:
        """The group of every rank (None: torch.distributed's default group)."""
        return self.world.whole(self.rank)

    def control_device(self) -> torch.device:
        """Where small control tensors (votes, agreement rows) live: CPU when the world's
        groups move CPU tensors (Gloo, "cpu:gloo,cuda:nccl", in memory), else the current
        GPU."""
        return self.world.control_device()

    @property
    def intra_group(self) -> object:
        """My node's group (a ``torch.distributed`` process group, or the world's own kind);
        None when ``procs_per_node == 1``.

        The first access to this or :attr:`rail_group` creates every group (collective)."""
        return self._ensure_groups()[0]

    @property
    def rail_group(self) -> object:
        """My rail's group (my local rank on every node); None when ``num_nodes == 1``.

        The first access to this or :attr:`intra_group` creates every group (collective)."""
        return self._ensure_groups()[1]

    @property
    def whole(self) -> CommGroup:
        """The group of every rank as a :class:`~qcomm.collectives.group.CommGroup`, what the
        primitives (:mod:`.primitives`) take."""
        return resolve_group(self.world_group)

    @property
    def intra(self) -> CommGroup | None:
        """:attr:`intra_group` as a :class:`~qcomm.collectives.group.CommGroup` (resolved once,
        here, for every caller); None when ``procs_per_node == 1``. Creates every group on
        first access, as :attr:`intra_group` does."""
        return self._ensure_resolved()[0]

    @property
    def rail(self) -> CommGroup | None:
        """:attr:`rail_group` as a :class:`~qcomm.collectives.group.CommGroup` (resolved once);
        None when ``num_nodes == 1``. Creates every group on first access."""
        return self._ensure_resolved()[1]

    def _ensure_resolved(self) -> tuple[CommGroup | None, CommGroup | None]:
        if self._resolved is None:
            # None here means "no such group" (one rank per node, one node), not torch's
            # default group: it must not be resolved.
            self._resolved = tuple(None if g is None else resolve_group(g)
                                   for g in self._ensure_groups())  # type: ignore[assignment]
        return self._resolved  # type: ignore[return-value]

    def _ensure_groups(self) -> tuple:
        if self._groups is not None:
            return self._groups
        self.check_world()
        if self.world_size == 1:
            self._groups = (None, None)
            return self._groups
        if getattr(self.world, "spans_job", True):
            # (a world of linked nodes has no group over the job: they agree at the rendezvous)
            self._check_same_topology_everywhere()
        # Fixed order on every rank: node groups by node, then rails by local rank.
        nodes = [self.ranks_of_node(n) for n in range(self.num_nodes)] \
            if self.procs_per_node > 1 else []
        rails = [self.ranks_of_rail(lr) for lr in range(self.procs_per_node)] \
            if self.num_nodes > 1 else []
        groups = self.world.new_groups(nodes + rails, self.rank)
        intra = groups[self.node] if nodes else None
        rail = groups[len(nodes) + self.local_rank] if rails else None
        self._groups = (intra, rail)
        return self._groups

    def _check_same_topology_everywhere(self) -> None:
        """All-gather procs_per_node from every rank (3 ints): heterogeneous torchrun nodes, or
        ranks built with different arguments, fail here with one clear error on every rank
        instead of creating mismatched groups. Runs once, at group creation (collective anyway).
        """
        device = self.control_device()
        mine = torch.tensor([self.procs_per_node, self.rank, self.world_size], dtype=torch.int64,
                            device=device)
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=device)
        all_gather_flat(everyone, mine, self.whole)
        rows = everyone.view(self.world_size, 3).tolist()
        ppn = [r[0] for r in rows]
        if len(set(ppn)) != 1 or any(r[2] != self.world_size for r in rows):
            raise ValueError(
                f"ranks disagree on the topology: procs_per_node by rank = {ppn}, world_size "
                f"by rank = {[r[2] for r in rows]}; every node must run the same number of "
                f"ranks and every rank must build the same Topology"
            )

    # -----------------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Process groups do not pickle; a copy recreates them (collectively) on first access.
        state = dict(self.__dict__)
        state["_groups"] = None
        state["_resolved"] = None
        state["_world"] = None  # a copy runs under torch.distributed (threads do not travel)
        return state

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}, world_size={self.world_size}, "
                f"procs_per_node={self.procs_per_node}, num_nodes={self.num_nodes}, "
                f"node={self.node}, local_rank={self.local_rank})")
