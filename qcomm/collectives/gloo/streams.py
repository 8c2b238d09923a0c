"""Ordered message streams between gossip neighbours over ``torch.distributed``: the Gloo
implementation of :class:`~qcomm.collectives.links.MessageStreams`, what the wait-free gossip
sends on (the interface, and what bounds and ends a stream, are described there).

:class:`GlooStreams`: point-to-point on a Gloo group. Gloo transfers a message only into a
posted receive, and its point-to-point works report completion only from ``wait()``
(``is_completed()`` stays False until then, and a ``wait`` that times out closes the
connection), so each neighbour has a receiver thread that keeps ``depth`` receives posted and
waits on the oldest, and a sender thread that keeps ``depth`` sends in flight; vectors
(:meth:`GlooStreams.send_vector`, taken by the peer's caller) go out on a third thread while
any are queued. All block in Gloo's C++ code with the GIL released: no CPU while they wait.

A link's messages move on a *channel*: without ``connect=``, point-to-point with the neighbour
on the one process group of all members (:class:`GroupChannel`); with it, a group of its own
per link (a ``torch.distributed`` group's streams: :mod:`.link_groups`, since a wait that times
out closes every connection of its group; a group whose links change while the job runs:
:mod:`.pair_group`), made by the link's receiver thread (so opening a link never blocks the
caller) and aborted when the link is dropped or the streams close.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Protocol

import torch
import torch.distributed as dist

from qcomm.collectives.errors import PeerError, PeerLostError, PeerTimeoutError, backend_detail
from qcomm.collectives.links import TAG_MODULUS, MessageStreams, record
from qcomm.collectives.stats import CommStats
from qcomm.rendezvous.waiting import abandon_when

from .ends import LinkEnds

__all__ = ["Channel", "GlooStreams", "GroupChannel"]

# Receives (and sends) each neighbour keeps posted ahead. Gloo moves a message only into a
# posted receive, and a receive posted after one arrived is known to the sender a one-way delay
# later: a stream carries at most `depth` messages per round trip. 16 keeps a 100 ms round trip
# busy at a round every 6 ms; the buffers cost 16 messages per neighbour.
DEFAULT_DEPTH = 16
# How long close() waits in all for the links' threads to leave once their channels are
# aborted (threads on a shared group, which close() cannot abort, may take longer: daemons).
CLOSE_JOIN_S = 2.0


# ---------------------------------------------------------------------------------------------
# torch.distributed point-to-point


class Channel(Protocol):
    """How one link's messages move: tagged point-to-point sends and receives, posted."""

    def isend(self, t: torch.Tensor, tag: int) -> dist.Work: ...

    def irecv(self, t: torch.Tensor, tag: int) -> dist.Work: ...

    def close(self) -> None:
        """Release what the link holds (a group of its own is aborted)."""


class GroupChannel:
    """Point-to-point with member ``peer`` of a process group all members share."""

    def __init__(self, group: dist.ProcessGroup | None, peer: int) -> None:
        self.group, self.peer = group, peer

    def isend(self, t: torch.Tensor, tag: int) -> dist.Work:
        # group_dst/group_src are member indices in `group`: no global-rank translation
        return dist.isend(t, group=self.group, tag=tag, group_dst=self.peer)

    def irecv(self, t: torch.Tensor, tag: int) -> dist.Work:
        return dist.irecv(t, group=self.group, tag=tag, group_src=self.peer)

    def close(self) -> None:
        """Nothing: Gloo cancels nothing, a shared group's posted receives stay until it is
        destroyed."""


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
        self.channel: Channel | None = None  # made by the receiver thread
        # receiving
        self.ready: deque[torch.Tensor] = deque()
        self.discarding = False   # closing: what arrives is dropped, not kept for take()
        self.ended = False
        self.last_in = False  # its last message came (the stream was finished on its side)
        self.recv_error: PeerError | None = None
        self.heard = time.monotonic()
        # sending
        self.outbox: deque[torch.Tensor] = deque()   # messages queued, not yet posted
        self.unconfirmed = 0   # messages queued or posted, not yet received by the peer
        # A keepalive queued or posted, not yet sent (not counted in unconfirmed: the peer's
        # receiver reads it, its caller never takes it); at most one at a time.
        self.keepalive: torch.Tensor | None = None
        # Vectors (their own tags, taken by the peer's caller, not by its receiver thread) go
        # out on a thread of their own, started when one is queued and gone when none is
        # left: confirmed in line with the messages, a vector the peer's caller had not yet
        # asked for held up the confirmations behind it, and two ends whose backlogs filled
        # while their link was being made each waited in send_to for room that only the
        # other's caller, waiting in its own send_to, could make.
        self.vectors_out: deque[torch.Tensor] = deque()
        self.vectors_sent = 0
        self.vector_sender: threading.Thread | None = None
        self.vectors_received = 0
        self.send_error: PeerError | None = None
        self.closing = False
        self.receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                         name=f"qcomm-recv-{owner.rank}-from-{self.rank}")
        self.sender = threading.Thread(target=self._send_loop, daemon=True,
                                       name=f"qcomm-send-{owner.rank}-to-{self.rank}")

    def _connect(self) -> bool:
        """Make the link's channel (its own group blocks until the other end comes); False
        when it cannot be made (the failure is on the link, for both directions)."""
        o = self.owner
        try:
            # close() or drop() abandons the waits of a link still being made (its peer may
            # never come): the thread leaves at once instead of at the connect's bound
            with abandon_when(lambda: self.closing, f"gossip link to rank {self.rank}"):
                channel = o.connect(self.peer, self.rank)
        except RuntimeError as e:
            err = _peer_error(e, f"gossip link to rank {self.rank} (rank {o.rank})",
                              o.timeout_s, self.rank, o.level, self.heard)
            with self.cond:
                self.recv_error = self.send_error = err
                self.cond.notify_all()
            return False
        with self.cond:
            self.channel = channel
            # the silence counts from the stream's opening: a link that took long to make (a
            # busy rendezvous, a slow peer: the connect's own bounds) is not silent for it
            self.heard = time.monotonic()
            self.cond.notify_all()
            if self.closing:   # dropped while it was being made
                channel.close()
                return False
        return True

    def _receive_loop(self) -> None:
        o = self.owner
        posted: deque[tuple[torch.Tensor, object]] = deque()
        seq = 0  # stream position of the next receive to post (the message tag)
        if not self._connect():
            return
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
                    work = self.channel.irecv(buf, seq % TAG_MODULUS)
                    posted.append((buf, work))
                    seq += 1
                    room -= 1
                buf, work = posted[0]
                # The silence allowed is timeout_s since the previous message (or since the
                # stream opened), whenever this receive was posted.
                left = max(o.timeout_s - (time.monotonic() - self.heard), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left))
                posted.popleft()
                end = o.stream_end(buf, self.peer)
                with self.cond:
                    self.heard = time.monotonic()
                    if end == "goodbye":
                        self.ended = True
                        self.cond.notify_all()
                        return
                    if end == "keepalive":   # the neighbour waits, alive: nothing to deliver
                        continue
                    if not self.discarding:
                        self.ready.append(buf)
                    self.cond.notify_all()
                    if end == "last":  # nothing follows: the receives still posted stay
                        self.last_in = True  # unmatched until the group is destroyed
                        return
        except RuntimeError as e:
            err = _peer_error(e, f"gossip stream from rank {self.rank} (rank {o.rank})",
                              o.timeout_s, self.rank, o.level, self.heard)
            with self.cond:
                self.recv_error = err
                self.cond.notify_all()

    def _send_loop(self) -> None:
        o = self.owner
        posted: deque[tuple[object, float, bool]] = deque()
        seq = 0
        started = time.monotonic()
        with self.cond:   # the receiver thread makes the channel
            self.cond.wait_for(lambda: self.channel is not None or self.send_error is not None
                               or self.closing)
            if self.channel is None:
                return
        try:
            while True:
                with self.cond:
                    while not posted and not self.outbox and not self.closing:
                        self.cond.wait()
                    if self.closing and not posted and not self.outbox:
                        if self.k in o._dropped:   # flushed a dropped stream's last message
                            self.channel.close()
                        return
                    batch = []
                    while self.outbox and len(posted) + len(batch) < o.depth:
                        msg = self.outbox.popleft()
                        batch.append((msg, msg is self.keepalive))
                for msg, keepalive in batch:
                    # the work holds the tensor until it completes
                    posted.append((self.channel.isend(msg, seq % TAG_MODULUS), time.monotonic(),
                                   keepalive))
                    seq += 1
                if not posted:
                    continue
                work, started, keepalive = posted[0]
                left = max(o.timeout_s - (time.monotonic() - started), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left))
                posted.popleft()
                with self.cond:
                    if keepalive:
                        self.keepalive = None
                    else:
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

    def _vector_loop(self) -> None:
        """Send the queued vectors in order (tags above the messages'), each waited for up to
        the silence bound, then leave (:meth:`GlooStreams.send_vector` starts the thread)."""
        o = self.owner
        with self.cond:   # the receiver thread makes the channel
            self.cond.wait_for(lambda: self.channel is not None or self.send_error is not None
                               or self.closing)
        try:
            while True:
                with self.cond:
                    if (self.channel is None or not self.vectors_out or self.closing
                            or self.send_error is not None):
                        self.vector_sender = None
                        return
                    vector = self.vectors_out.popleft()
                    tag = TAG_MODULUS + self.vectors_sent
                    self.vectors_sent += 1
                started = time.monotonic()
                self.channel.isend(vector, tag).wait(
                    timeout=datetime.timedelta(seconds=o.timeout_s))
        except RuntimeError as e:
            err = _peer_error(e, f"vector to rank {self.rank} (rank {o.rank})", o.timeout_s,
                              self.rank, o.level, started)
            with self.cond:
                self.send_error = self.send_error or err
                self.vector_sender = None
                self.cond.notify_all()


class GlooStreams(MessageStreams, LinkEnds):
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
        stream_end: ``stream_end(message, sender member)``: ``"goodbye"`` when a message ends
            its stream (not delivered), ``"last"`` when it is delivered and nothing follows,
            None otherwise.
        stats: byte counter, or None.
        depth: receives and sends kept posted per neighbour.
        connect: ``connect(peer member, peer rank)`` makes a link's :class:`Channel` (called on
            the link's receiver thread; RuntimeError: the link failed); None: point-to-point
            on ``group``.
    """

    def __init__(self, group_ranks: list[int], group: dist.ProcessGroup | None, member: int,
                 peers: list[int], nbytes: int, *, max_backlog: int, timeout_s: float,
                 stream_end: Callable[[torch.Tensor, int], str | None],
                 stats: CommStats | None = None, level: str = "inter",
                 depth: int = DEFAULT_DEPTH,
                 connect: Callable[[int, int], Channel] | None = None) -> None:
        self._set_ends(group_ranks, group, member, peers, stats, level)
        self.nbytes = nbytes
        self.max_backlog = max_backlog
        self.timeout_s = timeout_s
        self.stream_end = stream_end
        self.depth = max(1, min(depth, max_backlog))
        self.connect = connect or (lambda peer, rank: GroupChannel(group, peer))
        self.cond = threading.Condition()
        self._links: list[_Link] = []
        self._dropped: set[int] = set()
        self._finished: set[int] = set()
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
            # A finished stream's last message must still leave (the other end waits for it):
            # its sender thread sends what is queued, then closes the channel.
            flush = k in self._finished and link.send_error is None and bool(
                link.outbox or link.unconfirmed)
            if not flush:
                link.outbox.clear()
            link.vectors_out.clear()
            link.ready.clear()
            self.cond.notify_all()
            channel = None if flush else link.channel
        if channel is not None:
            channel.close()   # a link's own group: its pending works fail, its threads leave

    def send_to(self, k: int, message: torch.Tensor) -> PeerError | None:
        link = self._links[k]
        # Half the silence bound: while this sender waits here, it sends nothing to its other
        # neighbours, who would count it lost after timeout_s of silence (seen: a joiner that
        # died before its link was made held both its neighbours here for timeout_s, and
        # each timed the other out as well).
        wait_s = self.timeout_s / 2
        with self.cond:
            ok = self.cond.wait_for(lambda: link.unconfirmed < self.max_backlog
                                    or link.send_error is not None, wait_s)
            if link.send_error is not None:
                return link.recv_error or link.send_error
            if not ok:
                link.send_error = PeerTimeoutError(
                    f"gossip stream to rank {link.rank} (rank {self.rank}): max_backlog="
                    f"{self.max_backlog} messages not taken", wait_s,
                    [link.rank], self.level)
                return link.send_error
            link.outbox.append(message)
            link.unconfirmed += 1
            self.cond.notify_all()
        record(self.level, self.stats, message)
        return None

    def keepalive(self, message: torch.Tensor) -> None:
        with self.cond:
            for k, link in enumerate(self._links):
                if (k in self._dropped or k in self._finished or link.closing
                        or link.send_error is not None or link.keepalive is not None):
                    continue
                link.keepalive = message
                link.outbox.append(message)
                record(self.level, self.stats, message)
            self.cond.notify_all()

    def send_vector(self, k: int, vector: torch.Tensor) -> None:
        link = self._links[k]
        with self.cond:
            if k in self._dropped:
                return
            link.vectors_out.append(vector)
            if link.vector_sender is None:
                link.vector_sender = threading.Thread(
                    target=link._vector_loop, daemon=True,
                    name=f"qcomm-vectors-{self.rank}-to-{link.rank}")
                link.vector_sender.start()
        record(self.level, self.stats, vector.view(-1).view(torch.uint8))

    def recv_vector(self, k: int, out: torch.Tensor, timeout_s: float | None = None
                    ) -> PeerError | None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        link = self._links[k]
        tag = TAG_MODULUS + link.vectors_received
        link.vectors_received += 1
        since = time.monotonic()
        with self.cond:
            self.cond.wait_for(lambda: link.channel is not None or link.recv_error is not None,
                               timeout_s)
            channel, err = link.channel, link.recv_error
        if channel is None:
            return err or PeerTimeoutError(f"vector from rank {link.rank} (rank {self.rank}): "
                                           "the link was not made", timeout_s, [link.rank],
                                           self.level)
        try:
            work = channel.irecv(out, tag)
            work.wait(timeout=datetime.timedelta(seconds=max(
                timeout_s - (time.monotonic() - since), 1e-3)))
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

    def wait_made(self, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(
                link.channel is not None or link.recv_error is not None
                for k, link in enumerate(self._links) if k not in self._dropped), timeout_s)

    def wait_any(self, timeout_s: float, known_ended: Collection[int] = ()) -> None:
        with self.cond:
            self.cond.wait_for(lambda: any(
                link.ready or (link.ended and k not in known_ended) or link.recv_error
                or link.send_error
                for k, link in enumerate(self._links) if k not in self._dropped), timeout_s)

    def ended(self, k: int) -> bool:
        with self.cond:
            return self._links[k].ended

    def close(self, goodbye: torch.Tensor | None = None) -> None:
        with self.cond:
            # Dropped streams were given up for dead: nothing is said to them or awaited. A
            # link still being made is waited for with the rest (a member that leaves soon
            # after its join still says goodbye), then abandoned below.
            links = [link for k, link in enumerate(self._links) if k not in self._dropped]
            for link in links:
                # Nothing ready is taken any more: what comes is dropped, so a full backlog
                # does not keep the receiver from the neighbour's goodbye or the link's end
                # (it waited for room, and close() waited out its bound for them).
                link.discarding = True
                link.ready.clear()
                if (goodbye is not None and link.send_error is None
                        and link.k not in self._finished):
                    link.outbox.append(goodbye)
                    link.unconfirmed += 1
            self.cond.notify_all()
            # The goodbye leaves before close() returns (a dead or departed peer never takes
            # it: at most a few seconds).
            # And the neighbours' goodbyes, so that no receiver thread is left blocked in a
            # Gloo wait when the process group is destroyed (a neighbour that died ended its
            # stream with an error; one that keeps training is given up after the bound).
            self.cond.wait_for(lambda: all((link.unconfirmed == 0 or link.send_error)
                                           and (link.ended or link.last_in
                                                or link.recv_error)
                                           for link in links),
                               min(self.timeout_s, 10.0))
            # Threads blocked in a Gloo wait cannot be interrupted (Gloo cancels nothing, and a
            # wait that times out closes the connection); they are daemons, and a goodbye or
            # the group's destruction ends their waits. A link still being made is abandoned:
            # its waits in the store end at their next poll (see _Link._connect).
            for link in self._links:
                link.closing = True
            self.cond.notify_all()
            done = [link.receiver for link in self._links
                    if link.ended or link.last_in or link.recv_error]
            done += [link.vector_sender for link in self._links if link.vector_sender]
        # Threads that are leaving: let them finish, so that the works they held (receives
        # posted ahead and never waited for) are released now, not while the interpreter or
        # the process group is being torn down.
        for thread in [*done, *(link.sender for link in links)]:
            thread.join(timeout=2.0)
        # Links with groups of their own: aborted, so no thread stays blocked and nothing of
        # them is left (no-op on a shared group).
        for link in self._links:
            if link.channel is not None:
                link.channel.close()
        # The aborted channels fail the waits still pending in the links' threads (a dropped
        # link's too): let those threads come back from Gloo and leave before this returns. A
        # daemon thread that returns from a C++ call while the interpreter finalizes aborts the
        # process ("terminate called without an active exception") after a run that had
        # finished: seen once, at the end of a job whose joiner had died during its join.
        deadline = time.monotonic() + CLOSE_JOIN_S
        for link in self._links:
            for thread in (link.receiver, link.sender, link.vector_sender):
                if thread is not None and thread.is_alive():
                    thread.join(max(0.0, deadline - time.monotonic()))
