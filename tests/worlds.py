"""What the bodies of multi-process tests share inside a pooled Gloo world.

A test body runs in the processes of a session-wide world (the ``gloo`` fixture of
``tests/conftest.py``), one body after another. Creating process groups is collective and costs
a round of connections, so the groups of a layout are created once per world, by the first body
that asks for them, and reused by the later ones: :func:`topology`.
"""

from __future__ import annotations

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
