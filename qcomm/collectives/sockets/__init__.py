"""The links between nodes over plain TCP, on one inbound port per node: what a job uses when
its sites let in one port per node and no more (Gloo's links need every port open between
every pair of machines). The wait-free gossip's streams run on them as on Gloo's
(:class:`~qcomm.collectives.gloo.streams.GlooStreams`, with a channel of this package).

The frames, the token's admission and the encryption are :mod:`qcomm.wire`'s (the rendezvous's
front uses them too).

- :mod:`.listener`: the node's one port, routing each admitted connection to its link.
- :mod:`.channel`: :class:`SocketChannel`, one link's tagged sends and receives.
- :mod:`.group`: :class:`SocketGroup`, the gossip group whose links these are.
"""

from typing import Any

from qcomm.wire.admission import AdmissionError
from qcomm.wire.token import job_token

from .channel import SocketChannel

__all__ = ["AdmissionError", "SocketChannel", "SocketGroup", "job_token"]


def __getattr__(name: str) -> Any:
    # SocketGroup on first use: it builds on the rendezvous's PairGroup, and the rendezvous
    # (its front, its tunnel) uses this package's admission and encryption, so importing the
    # group here would make the two packages import each other half-made.
    if name == "SocketGroup":
        from .group import SocketGroup

        return SocketGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
