"""Collectives over groups of ranks: torch.distributed process groups (Gloo for CPU tensors,
NCCL for CUDA) or the in-memory world's, behind one interface (:mod:`.group`).

- :class:`Topology`: who is on which node; intra-node groups and inter-node rails.
- :class:`IntraNodeAllreduce`: synchronous bucketed mean inside a node (full precision or codec).
- :class:`HierarchicalAllreduce`: intra reduce-scatter -> quantized rail allreduce -> intra
  all-gather; the synchronous baseline and the engine of :mod:`qcomm.hooks`.
- :mod:`qcomm.collectives.gossip`: asynchronous compressed (CHOCO) gossip between nodes.
- :class:`CommStats`: bytes sent per level; :class:`PeerError` (timeout, lost connection,
  corrupt payload): a peer failed, named with the link.

``mean_(..., async_op=True)`` returns a :class:`~qcomm.collectives.handles.Handle` (``wait()``,
``is_completed()``); the modules hold what the layers above use and tests check.
"""

from qcomm.collectives.errors import (
    CorruptPayloadError,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
)
from qcomm.collectives.gossip import CompressedGossip, consensus_distance, default_gamma
from qcomm.collectives.hierarchical import HierarchicalAllreduce
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology

__all__ = [
    "CommStats",
    "CompressedGossip",
    "CorruptPayloadError",
    "HierarchicalAllreduce",
    "IntraNodeAllreduce",
    "PeerError",
    "PeerLostError",
    "PeerTimeoutError",
    "Topology",
    "consensus_distance",
    "default_gamma",
]
