"""Compressed asynchronous gossip between nodes (CHOCO-SGD with bounded staleness).

Split as in SGP: :mod:`.graphs` (who talks to whom), :mod:`.mixing` (weights), :mod:`.transport`
(moving payloads: Gloo point-to-point or in-process), :mod:`.choco` (the algorithm),
:mod:`.simulate` (n members in one process, for tests and tuning).
"""

from qcomm.collectives.errors import PeerError, PeerLostError, PeerTimeoutError

from .choco import CompressedGossip, consensus_distance, default_gamma
from .graphs import GRAPHS, adjacency, neighbours
from .mixing import MIXINGS, mixing_matrix, spectral_gap
from .simulate import GossipSimulator

__all__ = [
    "GRAPHS",
    "MIXINGS",
    "CompressedGossip",
    "GossipSimulator",
    "PeerError",
    "PeerLostError",
    "PeerTimeoutError",
    "adjacency",
    "consensus_distance",
    "default_gamma",
    "mixing_matrix",
    "neighbours",
    "spectral_gap",
]
