"""Where one rank of a cluster run sits: its rank in the world, its node and its rank there,
the layout, and the interface that carries its node's traffic to the other nodes.

Read from the process group and torchrun's environment; imported by workload.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import training as T


@dataclass(frozen=True)
class Place:
    """Where this rank runs: its rank in the world, its node and its rank there, the layout,
    and the interface that carries its node's traffic to the other nodes."""

    rank: int
    world: int
    node: int
    local_rank: int
    layout: T.Layout
    iface: str

    @property
    def keeps_snapshots(self) -> bool:
        """Whether this rank keeps its node's snapshots: one per node, the node's ranks hold
        the same model."""
        return self.local_rank == 0


def find_place(seat: Any = None, nodes: int | None = None) -> Place:
    """This rank's place, from the process group and torchrun's environment; for linked nodes
    (``seat`` from :func:`rejoining.init_linked`, the job's ``nodes``) from the seat: the
    default group is then the node."""
    iface = os.environ.get("QCB_IFACE", "qceth0")
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if seat is not None and nodes is not None:
        return Place(seat.rank, nodes * procs, seat.node, local_rank, T.Layout(nodes, procs),
                     iface)
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", str(rank // procs)))
    return Place(rank, world, node, local_rank, T.Layout(world // procs, procs), iface)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/rank_place.py is a library of the cluster benchmark "
        "(where a rank sits), imported by workload.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
