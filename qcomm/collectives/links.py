"""The two ways a group moves gossip messages between a member and its neighbours, as
interfaces: one payload per round (:class:`Transport`, the bounded-staleness gossip) and ordered
streams (:class:`MessageStreams`, the wait-free gossip). A group makes them
(:meth:`~qcomm.collectives.group.CommGroup.transport`,
:meth:`~qcomm.collectives.group.CommGroup.streams`); the implementations stand beside the
groups that make them: ``torch.distributed``'s in :mod:`.gloo.transport` and
:mod:`.gloo.streams` (Gloo point-to-point), the in-memory world's in
:mod:`.memory.transport` and :mod:`.memory.streams`.

Transport: :meth:`Transport.exchange` starts one round: it posts one receive per neighbour,
*then* sends this member's payload to every neighbour, and returns a :class:`RoundHandle`
without waiting; ``handle.wait(timeout_s)`` finishes the round or raises
:class:`~qcomm.collectives.errors.PeerTimeoutError` naming the peers that did not answer.

Streams: each member has one outgoing stream to every neighbour and one incoming stream from
each, carrying its messages in order; the receiver takes what has arrived whenever it likes,
and nothing on either side waits for the other's progress, but for memory: at most
``max_backlog`` messages per neighbour sent and not yet taken (a sender at the bound waits up to
``timeout_s``). A stream silent past ``timeout_s`` fails with
:class:`~qcomm.collectives.errors.PeerTimeoutError`, a broken connection with
:class:`~qcomm.collectives.errors.PeerLostError`; a goodbye (:meth:`MessageStreams.close`)
ends it without an error. A member that waits in a collective point (a drain, an exact sum) and
sends nothing meanwhile keeps its streams alive (:meth:`MessageStreams.keeping_alive`): a
keepalive every fraction of ``timeout_s``, which the neighbour's stream reads and does not
deliver, so only a member that is really silent is counted so. Streams can be dropped and opened
while the others go on, finished one at a time (a last message, then nothing more on it), and
carry whole vectors beside the fixed-size messages.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

from qcomm.collectives.errors import PeerError
from qcomm.collectives.stats import CommStats

__all__ = ["KEEPALIVES_PER_TIMEOUT", "TAG_MODULUS", "MessageStreams", "RoundHandle", "Transport",
           "record", "take_through_goodbye"]

# Point-to-point tags of rounds are taken modulo this (the rounds in flight between a pair
# never reach it), vectors from it on.
TAG_MODULUS = 1 << 20
# Keepalives a waiting member sends per ``timeout_s``: its neighbours hear it several times
# within each bound, however late in a period their last message came.
KEEPALIVES_PER_TIMEOUT = 4


class RoundHandle(ABC):
    """One round's exchange in flight."""

    round: int

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until every receive and send of the round is done; after this the receive
        buffers hold the neighbours' payloads and the send buffer may be reused.

        Raises:
            PeerTimeoutError: some peer did not answer within ``timeout_s`` (or its connection
                broke); the transport is unusable afterwards.
        """

    @abstractmethod
    def is_completed(self) -> bool:
        """True when :meth:`wait` would return at once."""


class Transport(ABC):
    """Exchanges one payload per round with a fixed set of neighbours.

    Attributes:
        member: this member's index in the group (0-based, node order).
        size: number of members.
        peers: neighbour member indices; row k of ``recv`` in :meth:`exchange` receives from
            ``peers[k]``.
        peer_ranks: the peers' global ranks (for error messages).
    """

    member: int
    size: int
    peers: list[int]
    peer_ranks: list[int]

    @abstractmethod
    def exchange(self, round: int, payload: torch.Tensor, recv: torch.Tensor) -> RoundHandle:
        """Start round ``round``: receive ``peers[k]``'s payload into ``recv[k]``, send ``payload``
        to every peer. Non-blocking.

        Args:
            round: round number, >= 0, increasing by one per call.
            payload: uint8 ``[nbytes]``, contiguous; not modified until the handle completes.
            recv: uint8 ``[len(peers), nbytes]``, contiguous; not read until the handle completes.
        """

    def close(self) -> None:  # noqa: B027 (optional hook; the default has nothing to free)
        """Drop references to rounds in flight; never blocks (also after a timeout)."""


class MessageStreams(ABC):
    """One member's streams to and from its neighbours.

    Attributes:
        member: this member's index in the group (0-based, node order).
        size: number of members.
        peers: neighbour member indices; stream ``k`` connects with ``peers[k]``.
        peer_ranks: the neighbours' global ranks (for error messages).
        level: the stats level the bytes are counted under (``"inter"``).
        timeout_s: the silence after which a stream fails.
    """

    member: int
    size: int
    peers: list[int]
    peer_ranks: list[int]
    level: str
    timeout_s: float
    # True in a step-by-step simulation: nothing arrives while a member waits, so a wait for
    # what has not come yet fails at once instead of blocking.
    simulated: bool = False
    _dropped: set[int]  # streams given up (drop): nothing is sent on them or taken from them
    _finished: set[int]  # streams whose last message was sent (finish): still taken from

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
            if k in self._finished or self.ended(k):
                continue
            if (err := self.send_to(k, message)) is not None:
                failures.append((k, err))
        return failures

    def finish(self, k: int, message: torch.Tensor) -> PeerError | None:
        """Queue ``message`` as the last one on the stream to ``peers[k]`` (as
        :meth:`send_to`): nothing more is sent on it, and the stream from ``peers[k]`` is
        still taken from until its own last message (then :meth:`drop` it). Its failure, if
        any."""
        err = self.send_to(k, message)
        self._finished.add(k)
        return err

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

    def wait_made(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every link not dropped is made or has failed;
        whether all were (streams whose links exist from the start: at once)."""
        return True

    @abstractmethod
    def wait_any(self, timeout_s: float, known_ended: Collection[int] = ()) -> None:
        """Block until some stream has a message to take, has failed or ended, or
        ``timeout_s`` passed. Streams in ``known_ended`` (ended, as the caller has seen) wake
        it only with a message or a failure: an end already seen does not end every wait at
        once, as a member that waits out a drain beside a neighbour that left would spin."""

    def ended_now(self) -> set[int]:
        """The streams (indices, none dropped) that have ended with a goodbye so far."""
        return {k for k in range(len(self.peers)) if k not in self._dropped and self.ended(k)}

    @abstractmethod
    def ended(self, k: int) -> bool:
        """True once the stream from ``peers[k]`` ended with a goodbye."""

    def keepalive(self, message: torch.Tensor) -> None:  # noqa: B027 (optional: no silence)
        """Tell every open neighbour that this member is alive, delivering nothing:
        ``message`` (uint8 ``[nbytes]``, not modified afterwards) is one the neighbours'
        ``stream_end`` calls ``"keepalive"``. Never waits; a stream whose previous keepalive
        has not left yet gets no second one. Streams that measure no silence do nothing."""

    @contextmanager
    def keeping_alive(self, message: torch.Tensor) -> Iterator[None]:
        """While the body runs, :meth:`keepalive` ``KEEPALIVES_PER_TIMEOUT`` times per
        ``timeout_s`` (the silence the neighbours allow; once at the start) from a thread of
        its own: for a caller that waits in a collective point and sends nothing meanwhile.
        Only inside such bounded waits: a member hung elsewhere must still fall silent.
        Nothing in a simulation (no silence is measured there)."""
        if self.simulated:
            yield
            return
        stop = threading.Event()
        period_s = self.timeout_s / KEEPALIVES_PER_TIMEOUT

        def tick() -> None:
            while not stop.wait(period_s):
                self.keepalive(message)

        self.keepalive(message)
        ticker = threading.Thread(target=tick, daemon=True,
                                  name=f"qcomm-keepalive-{self.member}")
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()

    @abstractmethod
    def close(self, goodbye: torch.Tensor | None = None) -> None:
        """Send ``goodbye`` (the last message: the neighbours' streams from us end cleanly)
        when given, then stop. Never raises; waits a few seconds at most for the goodbye to
        leave and for the neighbours' own goodbyes."""


def take_through_goodbye(streams: MessageStreams, k: int
                         ) -> tuple[list[torch.Tensor], PeerError | None, bool]:
    """What stream ``k`` brought (:meth:`MessageStreams.take`), its failure, and whether it
    ended with a goodbye with every message before the goodbye in this take: the caller may
    then close the link with nothing left behind.

    A peer's messages come before its goodbye, so once the goodbye is seen one more take has
    them all; the goodbye is read before the take, and when it came during the take, the
    stream is taken again. Read only after a take, a goodbye that came just after it said
    the stream ended while its last messages were still waiting to be taken."""
    ended = streams.ended(k)
    msgs, err = streams.take(k)
    if not ended and streams.ended(k):
        more, err = streams.take(k)
        msgs, ended = msgs + more, True
    return msgs, err, ended


def record(level: str, stats: CommStats | None, message: torch.Tensor) -> None:
    """Count ``message`` (uint8) as sent under ``level``, when there is a counter."""
    if stats is not None:
        stats.record(level, message.numel())
