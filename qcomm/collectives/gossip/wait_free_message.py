"""What one message of the wait-free gossip holds, byte by byte.

    codec payload (nbytes) | header: int64 [size + 2] | seal (8 bytes)

The header says how the sender mixed in the round that sent it: per member of the group, its
*ack* (1 + the rounds of that member the sender's copy held when it mixed with it; 0 when it
did not), then 1 + the fragment it mixed (0: none) and the version of its own copy in its terms.
A control message (hello, marker, retire, keepalive, goodbye) is sealed with a round far beyond
any real one; a hello, a retire, a keepalive and a goodbye have zero codec bytes, a marker
carries the lost members it knows of.
"""

from __future__ import annotations

import torch

from qcomm.seeds import seal_key

from .integrity import SEAL_NBYTES, seal_

__all__ = ["ACK_NBYTES", "GOODBYE_ROUND", "HELLO_ROUND", "KEEPALIVE_ROUND", "MARKER_ROUND",
           "RETIRE_ROUND", "MessageLayout"]

# The rounds a keepalive, a retire, a hello, a marker (the d-th drain: MARKER_ROUND + d) and a
# goodbye are sealed with, far beyond any real round.
KEEPALIVE_ROUND = 1 << 58
RETIRE_ROUND = 1 << 59
HELLO_ROUND = 1 << 60
MARKER_ROUND = 1 << 61
GOODBYE_ROUND = 1 << 62
ACK_NBYTES = 8  # an int64 per member in every message: its ack


class MessageLayout:
    """The layout of one member's messages in a group of ``size`` members.

    Args:
        nbytes: codec bytes per message (``packed_nbytes`` of a fragment).
        size: members in the group (the header has one ack per member).
        member: this member's index (the one whose ack it reads from others' messages).
    """

    def __init__(self, nbytes: int, size: int, member: int) -> None:
        self.nbytes, self.size, self.member = nbytes, size, member
        self.header_nbytes = ACK_NBYTES * (size + 2)
        self.message_nbytes = nbytes + self.header_nbytes + SEAL_NBYTES

    def ack_field(self, m: torch.Tensor) -> torch.Tensor:
        """int64 ``[3]``: a message's ack for this member, 1 + the fragment it mixed (0: none),
        and the version of the sender's own copy in its terms."""
        at = self.nbytes + ACK_NBYTES * self.member
        end = self.nbytes + ACK_NBYTES * self.size
        return torch.cat([m[at:at + ACK_NBYTES], m[end:end + 2 * ACK_NBYTES]]).view(torch.int64)

    def write_header(self, message: torch.Tensor, acks: dict[int, int],
                     mix: tuple[int, int] | None) -> None:
        """Write the header of ``message`` (uint8 ``[message_nbytes]``): ``acks`` maps each
        member mixed with to 1 + its rounds in the copy; ``mix`` is (fragment, own version)."""
        head = torch.zeros(self.size + 2, dtype=torch.int64)
        for member, ack in acks.items():
            head[member] = ack
        if mix is not None:
            head[self.size], head[self.size + 1] = mix[0] + 1, mix[1]
        message[self.nbytes:self.nbytes + self.header_nbytes].copy_(head.view(torch.uint8))

    def control(self, round: int, body: torch.Tensor | None = None) -> torch.Tensor:
        """A hello, marker, retire or goodbye: codec bytes ``body`` (uint8, zero-padded; None: all
        zero) sealed with ``round`` by this member."""
        m = torch.zeros(self.message_nbytes, dtype=torch.uint8)
        if body is not None:
            m[:body.numel()] = body
        seal_(m, round, self.member)
        return m

    def keepalive(self) -> torch.Tensor:
        """What this member sends while it waits in a collective point (the streams'
        keepalive: read by the neighbour's stream, never delivered)."""
        return self.control(KEEPALIVE_ROUND)

    def stream_end(self, message: torch.Tensor, sender: int) -> str | None:
        """What ``message`` from member ``sender`` is to its stream: ``"goodbye"`` (it left:
        the stream ends), ``"last"`` (its retire: delivered, nothing follows),
        ``"keepalive"`` (it waits, alive: not delivered), None (a message to deliver)."""
        for round, end in ((GOODBYE_ROUND, "goodbye"), (KEEPALIVE_ROUND, "keepalive"),
                           (RETIRE_ROUND, "last")):
            if self.is_control(message, round, sender):
                return end
        return None

    def is_control(self, message: torch.Tensor, round: int, sender: int) -> bool:
        """Whether ``message`` from member ``sender`` is its control message ``round``: zero
        codec bytes sum to zero, so the seal is the key itself."""
        seal = int.from_bytes(message[-SEAL_NBYTES:].cpu().numpy().tobytes(), "little",
                              signed=True)
        return seal == seal_key(round, sender) and not bool(message[:self.nbytes].any())

    def lost_bits(self, lost: set[int]) -> torch.Tensor | None:
        """The members ``lost`` as a bit set, uint8 ``[ceil(size / 8)]`` (None when there are
        none, or when it does not fit in a message's codec bytes)."""
        if (self.size + 7) // 8 > self.nbytes or not lost:
            return None
        bits = torch.zeros(self.size, dtype=torch.bool)
        bits[sorted(lost)] = True
        bits = torch.nn.functional.pad(bits, (0, -self.size % 8)).view(-1, 8)
        return (bits.to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1).to(
            torch.uint8)

    def read_lost(self, marker: torch.Tensor) -> set[int]:
        """The members a marker says are lost (:meth:`lost_bits`)."""
        n = (self.size + 7) // 8
        if n > self.nbytes:
            return set()
        body = marker[:n].cpu()
        bits = ((body.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)
        return {int(i) for i in bits[:self.size].nonzero().view(-1)}
