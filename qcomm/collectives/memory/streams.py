"""The wait-free gossip's ordered message streams between members of one in-memory group.

:class:`Mailboxes` holds one group's queues per (sender, receiver); each member's
:class:`MemoryStreams` sends and takes on them, with the semantics of
:class:`~qcomm.collectives.gloo.streams.GlooStreams` (:class:`~qcomm.collectives.links.
MessageStreams` states them). In a stepped world the mailboxes run on the
simulation's clock and may hold a message back to emulate a slow link.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection

import torch

from qcomm.collectives.errors import PeerError, PeerLostError, PeerTimeoutError
from qcomm.collectives.links import MessageStreams, record
from qcomm.collectives.stats import CommStats

__all__ = ["Mailboxes", "MemoryStreams"]


class Mailboxes:
    """Per-(sender, receiver) queues of one in-process group's streams.

    Args:
        size: number of members.
        clock: None (members are threads: a message is visible once posted), or a function
            returning the current time of a simulation; then ``delay(src, dst)`` (in the
            clock's units) holds each message back before it is visible.
        delay: see ``clock``.
    """

    def __init__(self, size: int, *, clock: Callable[[], float] | None = None,
                 delay: Callable[[int, int], float] | None = None) -> None:
        self.size = size
        self.simulated = clock is not None
        self._clock = clock
        self._delay = delay
        self._queues: dict[tuple, deque] = {}
        self._cond = threading.Condition()
        self._aborted = False
        self.killed: set[int] = set()
        self.cuts: set[frozenset[int]] = set()   # connections broken, their ends running
        self._alive: dict[tuple[int, int], float] = {}   # (src, dst): src's last keepalive

    def _queue(self, src: int, dst: int, kind: str = "m") -> deque:
        return self._queues.setdefault((src, dst, kind), deque())

    def post(self, src: int, dst: int, message: torch.Tensor | None, kind: str = "m") -> None:
        """Queue ``message`` (None: the stream ends) from ``src`` to ``dst``; ``kind`` "v"
        for the vector queue. Nothing is queued from or to a killed member."""
        at = 0.0
        if self._clock is not None:
            at = self._clock() + (self._delay(src, dst) if self._delay else 0.0)
        with self._cond:
            if src in self.killed or dst in self.killed or self.is_cut(src, dst):
                return
            self._queue(src, dst, kind).append((at, message))
            self._cond.notify_all()

    def touch(self, src: int, dst: int) -> None:
        """``src`` tells ``dst`` it is alive (a keepalive: nothing is queued); not from or to
        a killed member, nor over a cut."""
        with self._cond:
            if src not in self.killed and dst not in self.killed and not self.is_cut(src, dst):
                self._alive[(src, dst)] = time.monotonic()

    def touched(self, src: int, dst: int) -> float:
        """When ``src`` last told ``dst`` it is alive (``time.monotonic()``; 0: never)."""
        with self._cond:
            return self._alive.get((src, dst), 0.0)

    def kill(self, member: int) -> None:
        """``member`` dies: what it sent and is queued stays (it was on the wire); then each
        of its streams fails as a broken connection (:meth:`lost`)."""
        with self._cond:
            self.killed.add(member)
            self._cond.notify_all()

    def cut(self, a: int, b: int) -> None:
        """The connection between members ``a`` and ``b`` breaks, both running (a link's
        transport aborted): what is queued between them is lost, nothing more is queued, and
        their streams to each other fail as broken connections, until either is revived."""
        with self._cond:
            self.cuts.add(frozenset((a, b)))
            for key in [key for key in self._queues if set(key[:2]) == {a, b}]:
                del self._queues[key]
            self._cond.notify_all()

    def mend(self, a: int, b: int) -> None:
        """Members ``a`` and ``b`` may connect again (the streams that failed stay failed;
        a link opened after this works)."""
        with self._cond:
            self.cuts.discard(frozenset((a, b)))
            self._cond.notify_all()

    def is_cut(self, a: int, b: int) -> bool:
        """Whether the connection between ``a`` and ``b`` was :meth:`cut`."""
        return frozenset((a, b)) in self.cuts

    def revive(self, member: int) -> None:
        """A killed ``member`` is started again: its connections are new (whatever its old
        self sent or was sent is gone)."""
        with self._cond:
            self.killed.discard(member)
            self.cuts = {c for c in self.cuts if member not in c}
            for key in [key for key in self._queues if member in key[:2]]:
                del self._queues[key]
            self._alive = {key: t for key, t in self._alive.items() if member not in key}
            self._cond.notify_all()

    def lost(self, src: int, dst: int, kind: str = "m") -> bool:
        """Whether ``src`` was killed and nothing of it is left to take by ``dst``, or their
        connection was :meth:`cut`."""
        with self._cond:
            return (src in self.killed and not self._queue(src, dst, kind)) \
                or self.is_cut(src, dst)

    def _visible(self, entry: tuple) -> bool:
        return self._clock is None or entry[0] <= self._clock()

    def take(self, src: int, dst: int, kind: str = "m", limit: int | None = None
             ) -> list[torch.Tensor | None]:
        """The visible messages from ``src`` to ``dst`` (at most ``limit``), in order
        (removed)."""
        out = []
        with self._cond:
            q = self._queue(src, dst, kind)
            while q and self._visible(q[0]) and (limit is None or len(out) < limit):
                out.append(q.popleft()[1])
            if out:
                self._cond.notify_all()
        return out

    def ready(self, src: int, dst: int, kind: str = "m") -> bool:
        """Whether a message from ``src`` to ``dst`` is visible (or ``src`` is lost)."""
        with self._cond:
            q = self._queue(src, dst, kind)
            return ((bool(q) and self._visible(q[0])) or (src in self.killed and not q)
                    or self.is_cut(src, dst))

    def pending(self, src: int, dst: int) -> int:
        """Messages from ``src`` not yet taken by ``dst``."""
        with self._cond:
            return len(self._queue(src, dst))

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` (called under the lock) holds; False on timeout, abort,
        or at once in a simulation (nothing changes while one member waits)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if self.simulated or self._aborted or left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def abort(self) -> None:
        """Wake every waiting member; their waits fail at once."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class MemoryStreams(MessageStreams):
    """Streams over :class:`Mailboxes` (members in one process).

    Silence is measured on the wall clock since the stream last delivered, as the Gloo receiver
    thread measures it; in a simulation (mailboxes with a clock) there is none to detect. A
    killed member's streams fail as broken connections once what it sent was taken.
    """

    def __init__(self, boxes: Mailboxes, member: int, peers: list[int], *,
                 max_backlog: int, timeout_s: float, stats: CommStats | None = None,
                 level: str = "inter", peer_ranks: list[int] | None = None) -> None:
        self.boxes = boxes
        self.member = member
        self.size = boxes.size
        self.peers = list(peers)
        self.peer_ranks = list(peer_ranks) if peer_ranks is not None else list(peers)
        self.level = level
        self.max_backlog = max_backlog
        self.timeout_s = timeout_s
        self.stats = stats
        self.simulated = boxes.simulated
        self._heard = [time.monotonic()] * len(self.peers)  # when each stream last delivered
        self._ended = [False] * len(self.peers)
        self._failed: list[PeerError | None] = [None] * len(self.peers)
        self._dropped: set[int] = set()
        self._finished: set[int] = set()

    def _lost_error(self, k: int, what: str) -> PeerLostError:
        return PeerLostError(f"gossip stream {what} rank {self.peer_ranks[k]} (member "
                             f"{self.member})", [self.peer_ranks[k]], self.level,
                             detail="the member was killed")

    def _open(self, k: int) -> bool:
        return not (self._ended[k] or self._failed[k] is not None or k in self._dropped)

    def blocked(self) -> bool:
        """Whether :meth:`send` would wait now (a neighbour holds ``max_backlog`` messages)."""
        return any(self._open(k) and self.boxes.pending(self.member, p) >= self.max_backlog
                   for k, p in enumerate(self.peers))

    def send_to(self, k: int, message: torch.Tensor) -> PeerError | None:
        p = self.peers[k]
        if self._failed[k] is None and (p in self.boxes.killed
                                        or self.boxes.is_cut(self.member, p)):
            self._failed[k] = self._lost_error(k, "to")
        if self._failed[k] is not None:
            return self._failed[k]
        room = lambda: self.boxes.pending(self.member, p) < self.max_backlog \
            or p in self.boxes.killed
        if not self.boxes.wait(room, self.timeout_s):
            if self.simulated:
                raise RuntimeError(
                    f"member {self.member} would wait for member {p} to take its messages "
                    f"(max_backlog={self.max_backlog}) in a simulation, where nothing moves "
                    "while it waits")
            self._failed[k] = PeerTimeoutError(
                f"gossip stream to rank {self.peer_ranks[k]} (member {self.member}): "
                f"max_backlog={self.max_backlog} messages not taken", self.timeout_s,
                [self.peer_ranks[k]], self.level)
            return self._failed[k]
        if p in self.boxes.killed:
            self._failed[k] = self._lost_error(k, "to")
            return self._failed[k]
        # Shared, as over Gloo: the sender does not touch a message it sent.
        self.boxes.post(self.member, p, message)
        record(self.level, self.stats, message)
        return None

    def open(self, peer: int, peer_rank: int) -> int:
        self.peers.append(peer)
        self.peer_ranks.append(peer_rank)
        self._heard.append(time.monotonic())
        self._ended.append(False)
        self._failed.append(None)
        return len(self.peers) - 1

    def drop(self, k: int) -> None:
        self._dropped.add(k)

    def take(self, k: int) -> tuple[list[torch.Tensor], PeerError | None]:
        if k in self._dropped:
            return [], None
        got = self.boxes.take(self.peers[k], self.member) if not self._ended[k] else []
        if not got and not self.simulated:
            # Members that are threads share one interpreter, which lets a thread run up to
            # sys.getswitchinterval() (5 ms: many steps of a small model) before another: a
            # member finding nothing would run ahead while its peers, whose messages it
            # waits for, stand still, a schedule no job of separate processes has (8 wait-free
            # members ended 40 steps 5-12% of their start's consensus distance apart instead
            # of 0.3-1%). Finding nothing, it lets the others run, as a process would.
            time.sleep(0)
        out = []
        for m in got:
            if m is None:
                self._ended[k] = True
                break
            out.append(m)
        now = time.monotonic()
        if self._failed[k] is None and not self._ended[k] \
                and self.boxes.lost(self.peers[k], self.member):
            # after the last message it sent, the connection breaks
            self._failed[k] = self._lost_error(k, "from")
        elif got:
            self._heard[k] = now
        elif (self._failed[k] is None and not self._ended[k] and not self.simulated
              and now - max(self._heard[k], self.boxes.touched(self.peers[k], self.member))
              > self.timeout_s):
            self._failed[k] = PeerTimeoutError(
                f"gossip stream from rank {self.peer_ranks[k]} (member {self.member})",
                self.timeout_s, [self.peer_ranks[k]], self.level)
        return out, self._failed[k]

    def keepalive(self, message: torch.Tensor) -> None:
        for k, p in enumerate(self.peers):
            if self._open(k) and k not in self._finished:
                self.boxes.touch(self.member, p)
                record(self.level, self.stats, message)

    def send_vector(self, k: int, vector: torch.Tensor) -> None:
        if k not in self._dropped:
            self.boxes.post(self.member, self.peers[k], vector, kind="v")
            record(self.level, self.stats, vector.view(-1).view(torch.uint8))

    def recv_vector(self, k: int, out: torch.Tensor, timeout_s: float | None = None
                    ) -> PeerError | None:
        p = self.peers[k]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        here = lambda: self.boxes.ready(p, self.member, "v")
        if not self.boxes.wait(here, timeout_s):
            return PeerTimeoutError(f"vector from rank {self.peer_ranks[k]} (member "
                                    f"{self.member})", timeout_s,
                                    [self.peer_ranks[k]], self.level)
        got = self.boxes.take(p, self.member, "v", limit=1)
        if not got:
            return self._lost_error(k, "from")
        out.copy_(got[0].view_as(out))
        return None

    def wait_any(self, timeout_s: float, known_ended: Collection[int] = ()) -> None:
        # a goodbye is a message in its box until taken: an ended stream wakes no one after it
        self.boxes.wait(lambda: any(self.boxes.ready(p, self.member)
                                    for k, p in enumerate(self.peers)
                                    if k not in self._dropped), timeout_s)

    def ended(self, k: int) -> bool:
        return self._ended[k]

    def close(self, goodbye: torch.Tensor | None = None) -> None:
        if goodbye is not None:
            for k, p in enumerate(self.peers):
                if k not in self._dropped and k not in self._finished:
                    self.boxes.post(self.member, p, None)


