"""In-process simulation of a gossip group: n :class:`~.choco.CompressedGossip` members over a
:class:`~.transport.MemoryHub`, the same code path as over Gloo minus the sockets.

Fast and deterministic: used to measure the default gamma and by the unit tests, which also
check that real multi-process runs give the very same bits.

    sim = GossipSimulator(4, numel=4096, graph="ring", spec=QuantSpec(4, 128, "stochastic"))
    xs = [torch.randn(4096) for _ in range(4)]
    for _ in range(100):
        sim.step(xs)          # every member does one step, in lock step
    print(sim.consensus_distance(xs))
"""

from __future__ import annotations

import math

import torch

from qcomm.collectives.stats import CommStats

from .choco import CompressedGossip
from .graphs import check_graph, neighbours
from .transport import MemoryHub, MemoryTransport


class GossipSimulator:
    """``n`` gossip members in one process; keyword arguments go to CompressedGossip (all but
    ``stats``: each member gets its own CommStats, ``self.stats[i]``)."""

    def __init__(self, n: int, numel: int, *, graph: str = "ring", **kwargs) -> None:
        check_graph(graph)
        self.n = n
        self.hub = MemoryHub(n)
        self.stats = [CommStats() for _ in range(n)]
        self.members = [
            CompressedGossip(list(range(n)), None, numel, graph=graph, stats=self.stats[i],
                             _transport=MemoryTransport(self.hub, i, neighbours(graph, i, n),
                                                        self.stats[i]),
                             **kwargs)
            for i in range(n)
        ]

    def step(self, xs: list[torch.Tensor]) -> None:
        """One step of every member on its ``xs[i]`` (float32 ``[numel]``, updated in place):
        everyone starts the round, then everyone applies and mixes (so staleness 0 works)."""
        for m, x in zip(self.members, xs, strict=True):
            m.begin(x)
        for m, x in zip(self.members, xs, strict=True):
            m.finish(x)

    @staticmethod
    def consensus_distance(xs: list[torch.Tensor]) -> float:
        """``sqrt(mean_i ||x_i - mean x||^2)`` in float64 (as :func:`.choco.consensus_distance`,
        same operation order, so the numbers match the distributed one)."""
        v = torch.stack([x.reshape(-1).to(torch.float64) for x in xs])
        mean = v.sum(dim=0) / len(xs)
        return math.sqrt(float(((v - mean) ** 2).sum()) / len(xs))
