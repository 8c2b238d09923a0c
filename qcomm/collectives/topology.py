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

Process groups: the constructor makes no collective, no blocking call and no ``.cuda()``. The
first access to :attr:`Topology.intra_group` or :attr:`Topology.rail_group` creates ALL groups
(every node's intra group, then every rail), because ``new_group`` is collective over the default
group: every rank must reach that first access at the same point of the program. Groups are
created with ``backend=None``, i.e. with the default group's backend configuration, so the device
and backend follow the tensors: after ``init_process_group("cpu:gloo,cuda:nccl")`` CPU tensors go
through Gloo and CUDA tensors through NCCL; after ``init_process_group("gloo")`` both go through
Gloo (CUDA tensors staged through host memory).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.primitives import all_gather_flat
from qcomm.validation import check_instance, check_int, fail

__all__ = ["Topology"]


def _env_int(env: Mapping[str, str], var: str, minimum: int) -> int | None:
    """An environment variable as an int >= ``minimum``; None when unset or empty."""
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        fail(f"environment variable {var}", f"an int >= {minimum}", raw)
    return check_int(f"environment variable {var}", value, low=minimum)


class Topology:
    """The node / local-rank layout of the job, and its intra-node and rail process groups.

    Args:
        procs_per_node: ranks per node (int >= 1 dividing ``world_size``); None reads
            ``LOCAL_WORLD_SIZE`` (torchrun), else 1. See the module docstring for the rules.
        rank: this process's global rank; default torch.distributed's, else ``RANK``.
        world_size: number of processes; default torch.distributed's, else ``WORLD_SIZE``.
        world: an in-process :class:`~qcomm.collectives.memory.MemoryWorld` whose groups stand
            in for process groups (ranks as threads; tests and simulations). Then ``rank`` and
            ``world_size`` must be given, and torch.distributed is not used.

    Attributes:
        rank, world_size, procs_per_node, num_nodes, node, local_rank: ints.
        node_ranks: global ranks on my node, by local rank.
        rail_ranks: global ranks with my local rank, by node.

    Raises:
        TypeError, ValueError: a bad argument or environment variable (named in the message),
            e.g. ``world_size`` not divisible by ``procs_per_node``.
    """

    def __init__(self, procs_per_node: int | None = None, *, rank: int | None = None,
                 world_size: int | None = None, world: MemoryWorld | None = None) -> None:
        env = os.environ
        if world is not None:
            check_instance("world", world, MemoryWorld)
            if rank is None or world_size is None:
                raise ValueError("rank and world_size must be given with world=")
            if world_size != world.world_size:
                raise ValueError(f"world_size={world_size!r} differs from the in-memory world's "
                                 f"{world.world_size}")
        initialized = world is None and dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else _env_int(env, "WORLD_SIZE", 1)
            if world_size is None:
                raise ValueError("world_size is unknown: pass world_size=, initialize "
                                 "torch.distributed, or set WORLD_SIZE")
        world_size = check_int("world_size", world_size, low=1)
        if rank is None:
            rank = dist.get_rank() if initialized else _env_int(env, "RANK", 0)
            if rank is None:
                raise ValueError("rank is unknown: pass rank=, initialize torch.distributed, "
                                 "or set RANK")
        rank = check_int("rank", rank, low=0, high=world_size, high_open=True,
                         what=f"an int in [0, world_size={world_size})")

        if procs_per_node is None:
            procs_per_node = self._procs_per_node_from_env(env, rank)
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

    @staticmethod
    def _procs_per_node_from_env(env: Mapping[str, str], rank: int) -> int:
        local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1)
        if local_world is None:
            return 1
        local_rank = _env_int(env, "LOCAL_RANK", 0)
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
    # pure layout queries (no communication)

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

    def check_world(self) -> None:
        """Raise RuntimeError unless torch.distributed runs the world this topology describes.

        A single-process topology (``world_size == 1``) needs no process group at all when
        torch.distributed is not initialized; an in-memory topology needs none.
        """
        if self._world is not None:
            return
        if not (dist.is_available() and dist.is_initialized()):
            if self.world_size == 1:
                return
            raise RuntimeError(
                f"torch.distributed is not initialized, but this Topology has world_size="
                f"{self.world_size}: call init_process_group first"
            )
        ws, rk = dist.get_world_size(), dist.get_rank()
        if ws != self.world_size or rk != self.rank:
            raise RuntimeError(
                f"Topology was built for rank {self.rank} of world_size {self.world_size}, but "
                f"torch.distributed runs rank {rk} of world_size {ws}"
            )

    @property
    def world_group(self) -> object:
        """The group of every rank: None (torch.distributed's default group) or the in-memory
        world's."""
        if self._world is not None:
            return self._world.group(range(self.world_size), self.rank)
        return None

    def control_device(self) -> torch.device:
        """Where small control tensors (votes, agreement rows) live: CPU when the default
        group can move CPU tensors (Gloo, or "cpu:gloo,cuda:nccl"), else the current GPU."""
        if self._world is not None or "cpu:" in dist.get_backend_config():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def in_memory(self) -> bool:
        """True when the groups are in-memory stand-ins (``world=`` was given)."""
        return self._world is not None

    @property
    def intra_group(self) -> dist.ProcessGroup | None:
        """Process group of my node's ranks; None when ``procs_per_node == 1``.

        The first access to this or :attr:`rail_group` creates every group (collective)."""
        return self._ensure_groups()[0]

    @property
    def rail_group(self) -> dist.ProcessGroup | None:
        """Process group of my rail (my local rank on every node); None when ``num_nodes == 1``.

        The first access to this or :attr:`intra_group` creates every group (collective)."""
        return self._ensure_groups()[1]

    def _ensure_groups(self) -> tuple:
        if self._groups is not None:
            return self._groups
        self.check_world()
        if self.world_size == 1:
            self._groups = (None, None)
            return self._groups
        if self._world is not None:
            self._groups = (
                self._world.group(self.node_ranks, self.rank) if self.procs_per_node > 1
                else None,
                self._world.group(self.rail_ranks, self.rank) if self.num_nodes > 1 else None,
            )
            return self._groups
        self._check_same_layout_everywhere()
        intra = rail = None
        # Fixed order on every rank: node groups by node, then rails by local rank. Every rank
        # calls new_group for every group, member or not (new_group is collective).
        if self.procs_per_node > 1:
            for node in range(self.num_nodes):
                group = dist.new_group(self.ranks_of_node(node))
                if node == self.node:
                    intra = group
        if self.num_nodes > 1:
            for local_rank in range(self.procs_per_node):
                group = dist.new_group(self.ranks_of_rail(local_rank))
                if local_rank == self.local_rank:
                    rail = group
        self._groups = (intra, rail)
        return self._groups

    def _check_same_layout_everywhere(self) -> None:
        """All-gather procs_per_node from every rank (3 ints): heterogeneous torchrun nodes, or
        ranks built with different arguments, fail here with one clear error on every rank
        instead of creating mismatched groups. Runs once, at group creation (collective anyway).
        """
        device = self.control_device()
        mine = torch.tensor([self.procs_per_node, self.rank, self.world_size], dtype=torch.int64,
                            device=device)
        everyone = torch.empty(self.world_size * 3, dtype=torch.int64, device=device)
        all_gather_flat(everyone, mine, None)
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
        state["_world"] = None  # threads and locks do not travel
        return state

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}, world_size={self.world_size}, "
                f"procs_per_node={self.procs_per_node}, num_nodes={self.num_nodes}, "
                f"node={self.node}, local_rank={self.local_rank})")
