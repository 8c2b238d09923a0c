"""Compressed asynchronous gossip between nodes (CHOCO-SGD), in two modes.

Split as in SGP: :mod:`.graphs` (who talks to whom), :mod:`.mixing` (weights), :mod:`.transport`
(one payload per round over Gloo point-to-point), :mod:`.streams` (ordered message streams per
neighbour), :mod:`.choco` (bounded staleness: every node at its slowest neighbour's pace,
deterministic), :mod:`.wait_free` (no node waits for a neighbour's round; its membership, who
is a neighbour now and the protocol that changes it, is :mod:`.membership`). Both modes mix a
fragment alike (:mod:`.member`). A member's group
makes its transport or streams (:class:`~qcomm.collectives.group.CommGroup`); n members in one
process, for tests and tuning, are the in-memory world's simulators
(:mod:`qcomm.collectives.memory.simulate`).
"""


from .choco import CompressedGossip, consensus_distance, default_gamma
from .graphs import GRAPHS, adjacency, neighbours
from .mixing import MIXINGS, mixing_matrix, spectral_gap
from .wait_free import WaitFreeGossip

__all__ = [
    "GRAPHS",
    "MIXINGS",
    "CompressedGossip",
    "WaitFreeGossip",
    "adjacency",
    "consensus_distance",
    "default_gamma",
    "mixing_matrix",
    "neighbours",
    "spectral_gap",
]
