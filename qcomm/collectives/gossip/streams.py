"""Ordered message streams between gossip neighbours: what the wait-free gossip sends on.

Each member has one outgoing stream to every neighbour and one incoming stream from each. A
stream carries the member's messages in the order they were sent (its rounds, and the markers
and goodbye of :mod:`.wait_free`; the streams do not look inside them); the receiver takes what
has arrived whenever it likes, without waiting, and nothing on either side waits for the other
member's progress. What bounds a stream is memory: at most ``max_backlog`` messages per
neighbour may be sent and not yet taken by that neighbour. A sender that reaches the bound
waits (up to ``timeout_s``) for the oldest one to be taken: a neighbour more than
``max_backlog`` rounds behind in *taking* messages (not in its own rounds) slows the sender.

Liveness: a stream that stays silent past ``timeout_s`` (no message since the previous one, or
since it was opened) fails with :class:`~qcomm.collectives.errors.PeerTimeoutError`; a broken
connection with :class:`~qcomm.collectives.errors.PeerLostError`. The failure is recorded and
returned by :meth:`MessageStreams.take`; the caller decides what to raise. A member that leaves
cleanly closes its streams with a goodbye message (:meth:`MessageStreams.close`), which ends
them at the neighbours without an error.

Two implementations:

* :class:`GlooStreams`: ``torch.distributed`` point-to-point on a Gloo group. Gloo transfers a
  message only into a posted receive, and its point-to-point works report completion only from
  ``wait()`` (``is_completed()`` stays False until then, and a ``wait`` that times out closes the
  connection), so each neighbour has a receiver thread that keeps ``depth`` receives posted and
  waits on the oldest, and a sender thread that keeps ``depth`` sends in flight. Both block in
  Gloo's C++ code with the GIL released: they cost no CPU while they wait.
* :class:`MemoryStreams`: members in one process (threads of an in-memory world, or the
  step-by-step simulator, which may hold a message back to emulate a slow link).
"""

from __future__ import annotations

import datetime
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from qcomm.collectives.errors import PeerError, PeerLostError, PeerTimeoutError
from qcomm.collectives.stats import CommStats

__all__ = ["GlooStreams", "Mailboxes", "MemoryStreams", "MessageStreams"]

TAG_MODULUS = 1 << 20
# Receives (and sends) each neighbour keeps posted ahead. Gloo moves a message only into a
# posted receive, and a receive posted after one arrived is known to the sender a one-way delay
# later: a stream carries at most `depth` messages per round trip. 16 keeps a 100 ms round trip
# busy at a round every 6 ms; the buffers cost 16 messages per neighbour.
DEFAULT_DEPTH = 16


class MessageStreams(ABC):
    """One member's streams to and from its neighbours.

    Attributes:
        member: this member's index in the group (0-based, node order).
        size: number of members.
        peers: neighbour member indices; stream ``k`` connects with ``peers[k]``.
        peer_ranks: the neighbours' global ranks (for error messages).
        level: the stats level the bytes are counted under (``"inter"``).
    """

    member: int
    size: int
    peers: list[int]
    peer_ranks: list[int]
    level: str
    # True in a step-by-step simulation: nothing arrives while a member waits, so a wait for
    # what has not come yet fails at once instead of blocking.
    simulated: bool = False

    @abstractmethod
    def send(self, message: torch.Tensor) -> None:
        """Queue ``message`` (uint8 ``[nbytes]``, not modified afterwards) on the stream to
        every neighbour whose stream has not ended. Returns at once unless a neighbour has
        ``max_backlog`` messages not yet taken: then waits for it to take one.

        Raises:
            PeerTimeoutError: that neighbour took nothing within ``timeout_s``.
            PeerError: the stream to a neighbour failed earlier.
        """

    @abstractmethod
    def take(self, k: int) -> tuple[list[torch.Tensor], PeerError | None]:
        """The messages from ``peers[k]`` that arrived since the previous call, in order, and
        the stream's failure if it failed (after the messages that arrived before it). Never
        blocks."""

    @abstractmethod
    def wait_any(self, timeout_s: float) -> None:
        """Block until some stream has a message to take, has failed or ended, or
        ``timeout_s`` passed."""

    @abstractmethod
    def ended(self, k: int) -> bool:
        """True once the stream from ``peers[k]`` ended with a goodbye."""

    @abstractmethod
    def close(self, goodbye: torch.Tensor | None = None) -> None:
        """Send ``goodbye`` (the last message: the neighbours' streams from us end cleanly)
        when given, then stop. Never raises; waits a few seconds at most for the goodbye to
        leave and for the neighbours' own goodbyes."""


def _record(level: str, stats: CommStats | None, message: torch.Tensor) -> None:
    if stats is not None:
        stats.record(level, message.numel())


# ---------------------------------------------------------------------------------------------
# in-process


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
        self._queues: dict[tuple[int, int], deque] = {}
        self._cond = threading.Condition()
        self._aborted = False

    def _queue(self, src: int, dst: int) -> deque:
        return self._queues.setdefault((src, dst), deque())

    def post(self, src: int, dst: int, message: torch.Tensor | None) -> None:
        """Queue ``message`` (None: the stream ends) from ``src`` to ``dst``."""
        at = 0.0
        if self._clock is not None:
            at = self._clock() + (self._delay(src, dst) if self._delay else 0.0)
        with self._cond:
            self._queue(src, dst).append((at, message))
            self._cond.notify_all()

    def _visible(self, entry: tuple) -> bool:
        return self._clock is None or entry[0] <= self._clock()

    def take(self, src: int, dst: int) -> list[torch.Tensor | None]:
        """Every visible message from ``src`` to ``dst``, in order (removed)."""
        out = []
        with self._cond:
            q = self._queue(src, dst)
            while q and self._visible(q[0]):
                out.append(q.popleft()[1])
            if out:
                self._cond.notify_all()
        return out

    def ready(self, src: int, dst: int) -> bool:
        """Whether a message from ``src`` to ``dst`` is visible."""
        with self._cond:
            q = self._queue(src, dst)
            return bool(q) and self._visible(q[0])

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
    thread measures it; in a simulation (mailboxes with a clock) there is none to detect.
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

    def blocked(self) -> bool:
        """Whether :meth:`send` would wait now (a neighbour holds ``max_backlog`` messages)."""
        return any(not self._ended[k] and self.boxes.pending(self.member, p) >= self.max_backlog
                   for k, p in enumerate(self.peers))

    def send(self, message: torch.Tensor) -> None:
        for k, p in enumerate(self.peers):
            if self._ended[k] or self._failed[k] is not None:
                continue
            room = lambda p=p: self.boxes.pending(self.member, p) < self.max_backlog
            if not self.boxes.wait(room, self.timeout_s):
                if self.simulated:
                    raise RuntimeError(
                        f"member {self.member} would wait for member {p} to take its messages "
                        f"(max_backlog={self.max_backlog}) in a simulation, where nothing moves "
                        "while it waits")
                raise PeerTimeoutError(f"gossip stream to rank {self.peer_ranks[k]} (member "
                                       f"{self.member}): max_backlog={self.max_backlog} "
                                       "messages not taken", self.timeout_s,
                                       [self.peer_ranks[k]], self.level)
            # Shared, as over Gloo: the sender does not touch a message it sent.
            self.boxes.post(self.member, p, message)
            _record(self.level, self.stats, message)

    def take(self, k: int) -> tuple[list[torch.Tensor], PeerError | None]:
        got = self.boxes.take(self.peers[k], self.member) if not self._ended[k] else []
        out = []
        for m in got:
            if m is None:
                self._ended[k] = True
                break
            out.append(m)
        now = time.monotonic()
        if got:
            self._heard[k] = now
        elif (self._failed[k] is None and not self._ended[k] and not self.simulated
              and now - self._heard[k] > self.timeout_s):
            self._failed[k] = PeerTimeoutError(
                f"gossip stream from rank {self.peer_ranks[k]} (member {self.member})",
                self.timeout_s, [self.peer_ranks[k]], self.level)
        return out, self._failed[k]

    def wait_any(self, timeout_s: float) -> None:
        self.boxes.wait(lambda: any(self.boxes.ready(p, self.member) for p in self.peers),
                        timeout_s)

    def ended(self, k: int) -> bool:
        return self._ended[k]

    def close(self, goodbye: torch.Tensor | None = None) -> None:
        if goodbye is not None:
            for p in self.peers:
                self.boxes.post(self.member, p, None)


# ---------------------------------------------------------------------------------------------
# torch.distributed point-to-point


def _peer_error(e: BaseException, what: str, timeout_s: float, rank: int, level: str,
                since: float) -> PeerError:
    """A Gloo failure as the named qcomm error: a timeout when the allowed silence passed,
    else the connection broke (the peer died)."""
    if time.monotonic() - since >= timeout_s * 0.999:
        return PeerTimeoutError(what, timeout_s, [rank], level)
    return PeerLostError(what, [rank], level, detail=str(e).strip().splitlines()[0][:200])


class _Link:
    """One neighbour: its receiver and sender threads and what they share with the caller."""

    def __init__(self, owner: GlooStreams, k: int) -> None:
        self.owner = owner
        self.k = k
        self.peer = owner.peers[k]
        self.rank = owner.peer_ranks[k]
        self.cond = owner.cond  # one lock and condition for all links: wait_any needs it
        # receiving
        self.ready: deque[torch.Tensor] = deque()
        self.ended = False
        self.recv_error: PeerError | None = None
        self.heard = time.monotonic()
        # sending
        self.outbox: deque[torch.Tensor] = deque()   # queued, not yet posted
        self.unconfirmed = 0   # queued or posted, not yet received by the peer
        self.send_error: PeerError | None = None
        self.closing = False
        self.receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                         name=f"qcomm-recv-{owner.rank}-from-{self.rank}")
        self.sender = threading.Thread(target=self._send_loop, daemon=True,
                                       name=f"qcomm-send-{owner.rank}-to-{self.rank}")

    def _receive_loop(self) -> None:
        o = self.owner
        posted: deque[tuple[torch.Tensor, object]] = deque()
        seq = 0  # stream position of the next receive to post (the message tag)
        try:
            while True:
                with self.cond:
                    # At most max_backlog messages ready or posted.
                    while (not posted and not self.closing
                           and len(self.ready) >= o.max_backlog):
                        self.cond.wait()
                    if self.closing:
                        return
                    room = o.max_backlog - len(self.ready) - len(posted)
                while len(posted) < o.depth and room > 0:
                    buf = torch.empty(o.nbytes, dtype=torch.uint8)
                    work = dist.irecv(buf, group=o.group, tag=seq % TAG_MODULUS,
                                      group_src=self.peer)
                    posted.append((buf, work))
                    seq += 1
                    room -= 1
                buf, work = posted[0]
                # The silence allowed is timeout_s since the previous message (or since the
                # stream opened), whenever this receive was posted.
                left = max(o.timeout_s - (time.monotonic() - self.heard), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left))
                posted.popleft()
                goodbye = o.is_goodbye(buf, self.peer)
                with self.cond:
                    self.heard = time.monotonic()
                    if goodbye:
                        self.ended = True
                        self.cond.notify_all()
                        return
                    self.ready.append(buf)
                    self.cond.notify_all()
        except RuntimeError as e:
            err = _peer_error(e, f"gossip stream from rank {self.rank} (rank {o.rank})",
                              o.timeout_s, self.rank, o.level, self.heard)
            with self.cond:
                self.recv_error = err
                self.cond.notify_all()

    def _send_loop(self) -> None:
        o = self.owner
        posted: deque[tuple[torch.Tensor, object, float]] = deque()
        seq = 0
        started = time.monotonic()
        try:
            while True:
                with self.cond:
                    while not posted and not self.outbox and not self.closing:
                        self.cond.wait()
                    if self.closing and not posted and not self.outbox:
                        return
                    batch = []
                    while self.outbox and len(posted) + len(batch) < o.depth:
                        batch.append(self.outbox.popleft())
                for msg in batch:
                    work = dist.isend(msg, group=o.group, tag=seq % TAG_MODULUS,
                                      group_dst=self.peer)
                    posted.append((msg, work, time.monotonic()))
                    seq += 1
                if not posted:
                    continue
                _msg, work, started = posted[0]
                left = max(o.timeout_s - (time.monotonic() - started), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left))
                posted.popleft()
                with self.cond:
                    self.unconfirmed -= 1
                    self.cond.notify_all()
        except RuntimeError as e:
            # A peer silent for timeout_s timed out, whichever side's wait noticed first (a
            # receive that times out closes the connection under a pending send).
            err = _peer_error(e, f"gossip stream to rank {self.rank} (rank {o.rank})",
                              o.timeout_s, self.rank, o.level, min(started, self.heard))
            with self.cond:
                self.send_error = err
                self.cond.notify_all()


class GlooStreams(MessageStreams):
    """Streams over a ``torch.distributed`` (Gloo) process group, moved by two threads per
    neighbour (see the module docstring). The threads start in the constructor.

    Args:
        group_ranks: global ranks of the members, in member order.
        group: their process group.
        member: this process's member index.
        peers: neighbour member indices.
        nbytes: length of every message, bytes.
        max_backlog: messages per neighbour sent and not yet taken (>= 1).
        timeout_s: the silence after which a stream fails.
        is_goodbye: ``is_goodbye(message, sender member)``: whether a message ends its stream.
        stats: byte counter, or None.
        depth: receives and sends kept posted per neighbour.
    """

    def __init__(self, group_ranks: list[int], group: dist.ProcessGroup | None, member: int,
                 peers: list[int], nbytes: int, *, max_backlog: int, timeout_s: float,
                 is_goodbye: Callable[[torch.Tensor, int], bool],
                 stats: CommStats | None = None, level: str = "inter",
                 depth: int = DEFAULT_DEPTH) -> None:
        self.group_ranks = list(group_ranks)
        self.group = group
        self.member = member
        self.size = len(group_ranks)
        self.rank = self.group_ranks[member]
        self.peers = list(peers)
        self.peer_ranks = [self.group_ranks[p] for p in peers]
        self.nbytes = nbytes
        self.max_backlog = max_backlog
        self.timeout_s = timeout_s
        self.is_goodbye = is_goodbye
        self.stats = stats
        self.level = level
        self.depth = max(1, min(depth, max_backlog))
        self.cond = threading.Condition()
        self._links = [_Link(self, k) for k in range(len(self.peers))]
        for link in self._links:
            link.receiver.start()
            link.sender.start()

    def send(self, message: torch.Tensor) -> None:
        for link in self._links:
            with self.cond:
                if link.ended:
                    continue
                ok = self.cond.wait_for(lambda link=link: link.unconfirmed < self.max_backlog
                                        or link.send_error is not None, self.timeout_s)
                if link.send_error is not None:
                    raise link.recv_error or link.send_error
                if not ok:
                    raise PeerTimeoutError(
                        f"gossip stream to rank {link.rank} (rank {self.rank}): max_backlog="
                        f"{self.max_backlog} messages not taken", self.timeout_s,
                        [link.rank], self.level)
                link.outbox.append(message)
                link.unconfirmed += 1
                self.cond.notify_all()
            _record(self.level, self.stats, message)

    def take(self, k: int) -> tuple[list[torch.Tensor], PeerError | None]:
        link = self._links[k]
        with self.cond:
            out = list(link.ready)
            link.ready.clear()
            self.cond.notify_all()   # room for the receiver to post more
            return out, link.recv_error

    def wait_any(self, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: any(link.ready or link.ended or link.recv_error
                                           for link in self._links), timeout_s)

    def ended(self, k: int) -> bool:
        with self.cond:
            return self._links[k].ended

    def close(self, goodbye: torch.Tensor | None = None) -> None:
        with self.cond:
            for link in self._links:
                if goodbye is not None and link.send_error is None:
                    link.outbox.append(goodbye)
                    link.unconfirmed += 1
            self.cond.notify_all()
            # The goodbye leaves before close() returns (a dead or departed peer never takes
            # it: at most a few seconds).
            # And the neighbours' goodbyes, so that no receiver thread is left blocked in a
            # Gloo wait when the process group is destroyed (a neighbour that died ended its
            # stream with an error; one that keeps training is given up after the bound).
            self.cond.wait_for(lambda: all((link.unconfirmed == 0 or link.send_error)
                                           and (link.ended or link.recv_error)
                                           for link in self._links),
                               min(self.timeout_s, 10.0))
            # Threads blocked in a Gloo wait cannot be interrupted (Gloo cancels nothing, and a
            # wait that times out closes the connection); they are daemons, and a goodbye or
            # the group's destruction ends their waits.
            for link in self._links:
                link.closing = True
            self.cond.notify_all()
            done = [link.receiver for link in self._links if link.ended or link.recv_error]
        # Threads that are leaving: let them finish, so that the works they held (receives
        # posted ahead and never waited for) are released now, not while the interpreter or
        # the process group is being torn down.
        for thread in [*done, *(link.sender for link in self._links)]:
            thread.join(timeout=2.0)
