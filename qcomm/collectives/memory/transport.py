"""The gossip's round-based exchange between members of one in-memory group.

:class:`MemoryHub` holds one group's payloads by (round, sender); each member's
:class:`MemoryTransport` posts its payload there and takes its neighbours'. Same bytes, same
counts as :class:`~qcomm.collectives.gloo.transport.GlooTransport`, no sockets. A hub of a
threaded world blocks a member's wait until the payloads arrive; one of a stepped world (one
thread drives every member) fails it at once, since nothing arrives while a member waits.
"""

from __future__ import annotations

import threading
import time

import torch

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.collectives.links import RoundHandle, Transport
from qcomm.collectives.stats import CommStats

__all__ = ["MemoryHub", "MemoryTransport"]


class MemoryHub:
    """Mailboxes shared by the :class:`MemoryTransport` s of one in-process group.

    Args:
        size: number of members.
        blocking: False (a stepped world, the lock-step simulator): a payload that is not
            posted when a member waits for it never will be, so waiting fails at once. True
            (members are threads): waiting blocks until the payload is posted or the timeout
            expires.
    """

    def __init__(self, size: int, *, blocking: bool = False):
        self.size = size
        self.blocking = blocking
        self._boxes: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._cond = threading.Condition()
        self._aborted = False

    def post(self, round: int, src: int, payload: torch.Tensor, readers: int) -> None:
        if readers:
            with self._cond:
                self._boxes[(round, src)] = (payload.clone(), readers)
                self._cond.notify_all()

    def has(self, round: int, src: int) -> bool:
        with self._cond:
            return (round, src) in self._boxes

    def wait_for(self, round: int, srcs: list[int], timeout_s: float) -> list[int]:
        """Wait until every source in ``srcs`` posted ``round``; return those still missing
        (all of them at once when the hub is not blocking, or after :meth:`abort`)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [s for s in srcs if (round, s) not in self._boxes]
                left = deadline - time.monotonic()
                if not missing or not self.blocking or self._aborted or left <= 0:
                    return missing
                self._cond.wait(left)

    def take(self, round: int, src: int, out: torch.Tensor) -> None:
        with self._cond:
            payload, readers = self._boxes[(round, src)]
            if readers == 1:
                del self._boxes[(round, src)]
            else:
                self._boxes[(round, src)] = (payload, readers - 1)
        out.copy_(payload)

    def abort(self) -> None:
        """Wake every waiting member; their waits report the missing payloads at once."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class _MemoryRound(RoundHandle):
    def __init__(self, round: int, owner: MemoryTransport, recv: torch.Tensor):
        self.round = round
        self._owner = owner
        self._recv = recv
        self._done = False

    def is_completed(self) -> bool:
        hub = self._owner.hub
        return self._done or all(hub.has(self.round, p) for p in self._owner.peers)

    def wait(self, timeout_s: float) -> None:
        if self._done:
            return
        o = self._owner
        missing = o.hub.wait_for(self.round, o.peers, timeout_s)
        if missing:
            ranks = [o.peer_ranks[o.peers.index(p)] for p in missing]
            raise PeerTimeoutError(f"gossip round {self.round} (member {o.member})", timeout_s,
                                   ranks, o.level)
        for k, p in enumerate(o.peers):
            o.hub.take(self.round, p, self._recv[k])
        self._done = True


class MemoryTransport(Transport):
    """In-process transport: member ``member`` of ``hub``'s group, exchanging with ``peers``
    (``peer_ranks``: the names used in errors, default the member indices)."""

    def __init__(self, hub: MemoryHub, member: int, peers: list[int],
                 stats: CommStats | None = None, level: str = "inter",
                 peer_ranks: list[int] | None = None):
        self.hub = hub
        self.member = member
        self.size = hub.size
        self.peers = list(peers)
        self.peer_ranks = list(peer_ranks) if peer_ranks is not None else list(peers)
        self.stats = stats
        self.level = level

    def exchange(self, round: int, payload: torch.Tensor, recv: torch.Tensor) -> RoundHandle:
        # Graphs are undirected: whoever we receive from also reads our payload.
        self.hub.post(round, self.member, payload, readers=len(self.peers))
        if self.stats is not None and self.peers:
            self.stats.record(self.level, payload.numel() * len(self.peers),
                              messages=len(self.peers))
        return _MemoryRound(round, self, recv)
