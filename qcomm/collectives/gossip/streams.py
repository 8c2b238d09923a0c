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

Membership: a stream can be dropped (:meth:`MessageStreams.drop`: its neighbour is treated as
gone) and a stream to a new neighbour opened (:meth:`MessageStreams.open`) while the others go
on; the wait-free gossip does both when a neighbour is lost. Beside the fixed-size messages, a
stream carries whole vectors (:meth:`MessageStreams.send_vector` /
:meth:`MessageStreams.recv_vector`), in their own order: a new neighbour's starting copy, the
survivors' exact average.

A group makes its members' streams (:meth:`~qcomm.collectives.group.CommGroup.streams`):

* :class:`GlooStreams`, here: ``torch.distributed`` point-to-point on a Gloo group. Gloo transfers a
  message only into a posted receive, and its point-to-point works report completion only from
  ``wait()`` (``is_completed()`` stays False until then, and a ``wait`` that times out closes the
  connection), so each neighbour has a receiver thread that keeps ``depth`` receives posted and
  waits on the oldest, and a sender thread that keeps ``depth`` sends in flight. Both block in
  Gloo's C++ code with the GIL released: they cost no CPU while they wait.
* the in-memory world's (:mod:`qcomm.collectives.memory.streams`): members in one process
  (threads, or driven step by step by a simulator, which may hold a message back to emulate
  a slow link).
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

from qcomm.collectives.errors import PeerError, PeerLostError, PeerTimeoutError, backend_detail
from qcomm.collectives.stats import CommStats

__all__ = ["GlooStreams", "MessageStreams", "record"]

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
    _dropped: set[int]  # streams given up (drop): nothing is sent on them or taken from them

    def send(self, message: torch.Tensor) -> list[tuple[int, PeerError]]:
        """Queue ``message`` (uint8 ``[nbytes]``, not modified afterwards) on the stream to
        every neighbour whose stream is open (not ended, dropped or failed). Returns at once
        unless a neighbour has ``max_backlog`` messages not yet taken: then waits for it to
        take one.

        Returns:
            ``(k, error)`` for every stream the message was not queued on because it failed
            (earlier, or now: that neighbour took nothing within ``timeout_s``,
            :class:`~qcomm.collectives.errors.PeerTimeoutError`); the caller decides.
        """
        failures = []
        for k in self.live():
            if not self.ended(k) and (err := self.send_to(k, message)) is not None:
                failures.append((k, err))
        return failures

    @abstractmethod
    def send_to(self, k: int, message: torch.Tensor) -> PeerError | None:
        """Queue ``message`` on stream ``k`` only (as :meth:`send`); its failure, if any."""

    @abstractmethod
    def open(self, peer: int, peer_rank: int) -> int:
        """Open streams to and from member ``peer`` (global rank ``peer_rank``): returns its
        index ``k``. The neighbour must open its streams to this member too."""

    @abstractmethod
    def drop(self, k: int) -> None:
        """Stop stream ``k`` (both directions), without a goodbye: nothing more is sent on it
        or taken from it. Other streams are untouched."""

    def live(self) -> list[int]:
        """Indices of the streams not dropped."""
        return [k for k in range(len(self.peers)) if k not in self._dropped]

    @abstractmethod
    def send_vector(self, k: int, vector: torch.Tensor) -> None:
        """Send ``vector`` (any dtype, contiguous, on the CPU, not modified afterwards) to
        ``peers[k]``, ordered with this stream's other vectors, not with its messages.
        Returns at once; a failure shows on the stream."""

    @abstractmethod
    def recv_vector(self, k: int, out: torch.Tensor, timeout_s: float | None = None
                    ) -> PeerError | None:
        """Receive ``peers[k]``'s next vector into ``out`` (its shape and dtype), waiting up
        to ``timeout_s`` (None: the streams'); the failure instead, if any (``out`` is then
        undefined)."""

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


def record(level: str, stats: CommStats | None, message: torch.Tensor) -> None:
    """Count ``message`` (uint8) as sent under ``level``, when there is a counter."""
    if stats is not None:
        stats.record(level, message.numel())


# ---------------------------------------------------------------------------------------------
# torch.distributed point-to-point


def _peer_error(e: BaseException, what: str, timeout_s: float, rank: int, level: str,
                since: float) -> PeerError:
    """A Gloo failure as the named qcomm error: a timeout when the allowed silence passed,
    else the connection broke (the peer died)."""
    if time.monotonic() - since >= timeout_s * 0.999:
        return PeerTimeoutError(what, timeout_s, [rank], level)
    return PeerLostError(what, [rank], level, detail=backend_detail(e))


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
        # queued, not yet posted: messages, and (vector,) tuples (their own tags)
        self.outbox: deque[torch.Tensor | tuple[torch.Tensor]] = deque()
        self.unconfirmed = 0   # messages queued or posted, not yet received by the peer
        self.vectors_received = 0
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
        posted: deque[tuple[bool, object, float]] = deque()
        seq = vseq = 0
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
                    if isinstance(msg, tuple):  # a vector: tags above the messages'
                        work = dist.isend(msg[0], group=o.group, tag=TAG_MODULUS + vseq,
                                          group_dst=self.peer)
                        vseq += 1
                    else:
                        work = dist.isend(msg, group=o.group, tag=seq % TAG_MODULUS,
                                          group_dst=self.peer)
                        seq += 1
                    # the work holds the tensor until it completes
                    posted.append((not isinstance(msg, tuple), work, time.monotonic()))
                if not posted:
                    continue
                is_message, work, started = posted[0]
                left = max(o.timeout_s - (time.monotonic() - started), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left))
                posted.popleft()
                with self.cond:
                    self.unconfirmed -= is_message
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
        self._links: list[_Link] = []
        self._dropped: set[int] = set()
        for p in self.peers:
            self._start_link(p)

    def _start_link(self, peer: int) -> int:
        k = len(self._links)
        if len(self.peers) == k:  # opened after the constructor
            self.peers.append(peer)
            self.peer_ranks.append(self.group_ranks[peer])
        link = _Link(self, k)
        self._links.append(link)
        link.receiver.start()
        link.sender.start()
        return k

    def open(self, peer: int, peer_rank: int) -> int:
        return self._start_link(peer)

    def drop(self, k: int) -> None:
        link = self._links[k]
        with self.cond:
            self._dropped.add(k)
            # Its threads leave at their next wake-up (a dead peer's waits fail); daemons.
            link.closing = True
            link.outbox.clear()
            link.ready.clear()
            self.cond.notify_all()

    def send_to(self, k: int, message: torch.Tensor) -> PeerError | None:
        link = self._links[k]
        with self.cond:
            ok = self.cond.wait_for(lambda: link.unconfirmed < self.max_backlog
                                    or link.send_error is not None, self.timeout_s)
            if link.send_error is not None:
                return link.recv_error or link.send_error
            if not ok:
                link.send_error = PeerTimeoutError(
                    f"gossip stream to rank {link.rank} (rank {self.rank}): max_backlog="
                    f"{self.max_backlog} messages not taken", self.timeout_s,
                    [link.rank], self.level)
                return link.send_error
            link.outbox.append(message)
            link.unconfirmed += 1
            self.cond.notify_all()
        record(self.level, self.stats, message)
        return None

    def send_vector(self, k: int, vector: torch.Tensor) -> None:
        link = self._links[k]
        with self.cond:
            if k in self._dropped:
                return
            link.outbox.append((vector,))
            self.cond.notify_all()
        record(self.level, self.stats, vector.view(-1).view(torch.uint8))

    def recv_vector(self, k: int, out: torch.Tensor, timeout_s: float | None = None
                    ) -> PeerError | None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        link = self._links[k]
        tag = TAG_MODULUS + link.vectors_received
        link.vectors_received += 1
        since = time.monotonic()
        try:
            work = dist.irecv(out, group=self.group, tag=tag, group_src=link.peer)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            return _peer_error(e, f"vector from rank {link.rank} (rank {self.rank})",
                               timeout_s, link.rank, self.level, since)
        return None

    def take(self, k: int) -> tuple[list[torch.Tensor], PeerError | None]:
        link = self._links[k]
        with self.cond:
            if k in self._dropped:
                return [], None
            out = list(link.ready)
            link.ready.clear()
            self.cond.notify_all()   # room for the receiver to post more
            return out, link.recv_error or (link.send_error if not link.ended else None)

    def wait_any(self, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: any(
                link.ready or link.ended or link.recv_error or link.send_error
                for k, link in enumerate(self._links) if k not in self._dropped), timeout_s)

    def ended(self, k: int) -> bool:
        with self.cond:
            return self._links[k].ended

    def close(self, goodbye: torch.Tensor | None = None) -> None:
        with self.cond:
            # Dropped streams were given up for dead: nothing is said to them or awaited.
            links = [link for k, link in enumerate(self._links) if k not in self._dropped]
            for link in links:
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
                                           for link in links),
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
        for thread in [*done, *(link.sender for link in links)]:
            thread.join(timeout=2.0)
