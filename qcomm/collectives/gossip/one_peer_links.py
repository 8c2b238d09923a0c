"""One link of the wait-free gossip on the one-peer graph: its two CHOCO public copies, its
counts, and the paired terms over it (:class:`PeerLink`).

Each link (i, p) is its own CHOCO pair over one ordered stream: i compresses against its copy
of the link (``fresh``, every own message on the link in it) and p rebuilds that copy from the
messages in the order sent, so both ends hold the same bits whatever the rounds each is at.
A message is ``payload | int64 [ack, fragment] | seal`` sealed with the link's message count
(the next count expected: a lost, repeated or reordered message fails the seal).

Paired terms: when i adds a term on fragment f with p's copy holding p's first ``a`` link
messages and its own copy holding its first ``b`` (the message just sent), it adds
``c (theirs[f] - fresh[f])`` and the message says ``ack = a + 1``; p, once it has applied that
message (its copy of i then holds ``b``), owes ``c (theirs[f] - own[f] at a)``, the same
difference negated: the pair's sum, and the members' average, move by the local steps alone.
A term needs a message of p of that fragment newer than the last term's (at most one term per
version of the partner's copy: a fast member cannot pile terms on a stale one).
"""

from __future__ import annotations

from collections import deque

import torch

from .codec import GossipCodec
from .integrity import SEAL_NBYTES
from .member import fragment_slice

__all__ = ["HEADER_NBYTES", "PeerLink", "read_header", "write_header"]

HEADER_NBYTES = 16  # int64 [ack (0: no term), fragment]


def write_header(message: torch.Tensor, nbytes: int, ack: int, fragment: int) -> None:
    """Write ``[ack, fragment]`` after the codec bytes of ``message`` (uint8)."""
    head = torch.tensor([ack, fragment], dtype=torch.int64).view(torch.uint8)
    message[nbytes:nbytes + HEADER_NBYTES].copy_(head)


def read_header(message: torch.Tensor, nbytes: int) -> tuple[int, int]:
    """``(ack, fragment)`` of a verified message (one host read)."""
    head = message[nbytes:nbytes + HEADER_NBYTES].cpu().clone().view(torch.int64)
    return int(head[0]), int(head[1])


class PeerLink:
    """This member's state of its link to ``peer`` (module docstring).

    Args:
        peer, rank: the member at the other end and its global rank.
        codec: decodes a fragment's payloads; ``fragments``: of the gossiped vector.
        numel: floats of a copy; ``device``: where the copies live.
        step: c, the weight of a term (half the pair's step: each end adds its own terms
            and the mirrors of the other's).

    Buffers: ``fresh`` and ``theirs``, float32 ``[numel]``, and the own messages the partner
    has not acknowledged yet (to rebuild ``fresh`` at the version a mirror names).
    """

    def __init__(self, peer: int, rank: int, codec: GossipCodec, fragments: int, numel: int,
                 device: torch.device, step: float) -> None:
        self.peer, self.rank, self.live = peer, rank, True
        self._codec, self.fragments, self.step = codec, fragments, step
        self.fragment_numel = codec.numel
        self.fresh = torch.zeros(numel, dtype=torch.float32, device=device)
        self.theirs = torch.zeros(numel, dtype=torch.float32, device=device)
        self.sent = self.received = 0        # link messages sent / applied
        self.held = [0] * fragments          # the partner's messages applied, per fragment
        self.termed = [0] * fragments        # held[f] at the last own term on f
        self.acked = 0                       # own messages the partner's last term held
        self.terms = self.mirrors = 0        # terms added, mirrors owed (statistics)
        self.markers = 0                     # drain markers received
        self.inbox: deque[torch.Tensor] = deque()   # taken, not sorted yet (past a drain's cut)
        # (seq, fragment, codec bytes, scales bounded): own messages from ``acked`` on
        self.own: deque[tuple[int, int, torch.Tensor, bool]] = deque()

    def _frag(self, f: int) -> slice:
        return fragment_slice(f, self.fragment_numel)

    def term_ack(self, f: int) -> int:
        """The ack of an own term on fragment f now (``received + 1``), or 0 when the
        partner's copy of f has not changed since the last term (or holds nothing yet)."""
        return self.received + 1 if self.held[f] > self.termed[f] else 0

    def sent_message(self, f: int, body: torch.Tensor, bounded: bool) -> None:
        """An own message of fragment f (codec bytes ``body``) left on the link."""
        self._codec.accumulate(body, self.fresh[self._frag(f)], checked=not bounded)
        self.own.append((self.sent, f, body, bounded))
        self.sent += 1

    def own_term(self, f: int) -> torch.Tensor:
        """``theirs[f] - fresh[f]`` (a new tensor); counts the term."""
        self.termed[f] = self.held[f]
        self.terms += 1
        frag = self._frag(f)
        return torch.sub(self.theirs[frag], self.fresh[frag])

    def own_at(self, f: int, version: int) -> torch.Tensor:
        """Fragment f of ``fresh`` holding the own messages below ``version`` only."""
        out = self.fresh[self._frag(f)].clone()
        later = [(b, ok) for s, g, b, ok in self.own if s >= version and g == f]
        if later:
            minus = torch.full((len(later),), -1.0, dtype=torch.float32, device=out.device)
            self._codec.accumulate(torch.stack([b for b, _ in later]), out, minus,
                                   checked=not all(ok for _, ok in later))
        return out

    def apply(self, body: torch.Tensor, ack: int, f: int, owed: torch.Tensor) -> None:
        """Apply the partner's next message (verified codec bytes ``body`` of fragment f) to
        ``theirs``; with a term (``ack`` > 0) add its mirror, times c, to ``owed`` (float32
        ``[numel]``), and forget the own messages no later mirror needs."""
        frag = self._frag(f)
        self._codec.accumulate(body, self.theirs[frag])   # verified: bounded scales
        self.received += 1
        self.held[f] += 1
        if ack <= 0:
            return
        version = ack - 1
        owed[frag].add_(torch.sub(self.theirs[frag], self.own_at(f, version)), alpha=self.step)
        self.mirrors += 1
        self.acked = max(self.acked, version)   # acks only grow along a stream
        while self.own and self.own[0][0] < self.acked:
            self.own.popleft()

    def state(self) -> dict:
        return {"peer": self.peer, "fresh": self.fresh, "theirs": self.theirs,
                "sent": self.sent, "received": self.received, "held": list(self.held),
                "termed": list(self.termed), "acked": self.acked,
                "own": [(s, f, b.clone(), ok) for s, f, b, ok in self.own]}

    def restore(self, saved: dict) -> None:
        """Load :meth:`state` output (tensors copied onto this link's device)."""
        dev = self.fresh.device
        self.fresh = saved["fresh"].to(dev, torch.float32, copy=True)
        self.theirs = saved["theirs"].to(dev, torch.float32, copy=True)
        self.sent, self.received = int(saved["sent"]), int(saved["received"])
        self.held = [int(v) for v in saved["held"]]
        self.termed = [int(v) for v in saved["termed"]]
        self.acked = int(saved["acked"])
        self.own = deque((int(s), int(f), b.to(dev, copy=True), bool(ok))
                         for s, f, b, ok in saved["own"])


def message_nbytes(nbytes: int) -> int:
    """Bytes of a message with ``nbytes`` codec bytes: payload, header, seal."""
    return nbytes + HEADER_NBYTES + SEAL_NBYTES
