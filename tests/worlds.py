"""What the bodies of multi-process tests share inside a pooled Gloo world.

A test body runs in the processes of a session-wide world (the ``gloo`` fixture of
``tests/conftest.py``), one body after another. Creating process groups is collective and costs
a round of connections, so the groups of a layout are created once per world, by the first body
that asks for them, and reused by the later ones: :func:`topology`. Ranks of a one-shot world
leave as soon as they are done; bodies whose survivors must not see each other leave as a second
loss meet first: :func:`survivors_meet`.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from qcomm.collectives.topology import Topology

_TOPOLOGIES: dict[int, Topology] = {}


def topology(procs_per_node: int) -> Topology:
    """This process's :class:`Topology` with ``procs_per_node`` ranks per node, its groups
    created (collectively, so every rank of the world must call it in the same body)."""
    topo = _TOPOLOGIES.get(procs_per_node)
    if topo is None:
        topo = Topology(procs_per_node)
        _ = topo.intra_group  # creates every group now, on every rank
        _TOPOLOGIES[procs_per_node] = topo
    return topo


def survivors_meet(key: str, count: int, wait_s: float = 30.0) -> None:
    """Until ``count`` ranks have called this with ``key`` (through the world's store), or
    ``wait_s``: the survivors of a fault leave together, so that one leaving is not a second
    loss to another still finding the first. Rank 0 (the store's server) must be one of them."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + wait_s
    _count_to(store, key, count, deadline)
    # Rank 0 serves the store, and a rank still reading the count after its server left fails
    # (the connection closed): rank 0 leaves once every survivor has read it.
    if dist.get_rank() == 0:
        _count_to(store, f"{key}/read", count, deadline)
    else:
        store.add(f"{key}/read", 1)


def _count_to(store: dist.Store, key: str, count: int, deadline: float) -> None:
    """Add one to ``key``, then wait until it reaches ``count`` or ``deadline``."""
    store.add(key, 1)
    while int(store.add(key, 0)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
