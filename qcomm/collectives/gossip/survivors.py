"""The exact sum over the live members of a wait-free gossip, along its closed ring.

The sum runs from the lowest live member along the ring that the losses closed, the total is
passed around, and beside it go the count, the members someone knows to be lost and the members
that took part, so that every live member gets the same bits, learns the union of the losses
and knows every member that took part as live (a member that joined next to others is live to
the ones it never linked to as well: all of them report the same live nodes at the end).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcomm.collectives.errors import PeerError
from qcomm.collectives.links import MessageStreams

from .membership import Membership

__all__ = ["survivors_sum"]


def survivors_sum(members: Membership, streams: MessageStreams, t: torch.Tensor, op: str,
                  wait_s: float, fail: Callable[[int, PeerError], None]
                  ) -> tuple[torch.Tensor, int]:
    """The sum (``op="max"``: the element-wise maximum) of ``t`` (any dtype and shape) over
    the live members, and their count. Collective over the live members; this member has a
    live one beside it (its caller answers alone otherwise, before opening any stream).

    Args:
        members: this member's membership (its ring, its lost members; learns the union).
        streams: its message streams (the live links to its two ring neighbours).
        wait_s: how long to wait for each partial.
        fail: called with a link and its error when a partial does not come (the link is
            dropped), before the error is raised.

    Raises:
        PeerError: a member was lost during the sum (nothing is returned; the graph has closed
            over it, and another call sums the remaining members).
    """
    # Waiting for the partials, this member sends no round: keepalives, or its neighbours
    # would count it silent (a partial may take 2 timeout_s, upstream members finding a loss).
    with streams.keeping_alive(members.layout.keepalive()):
        return _ring_sum(members, streams, t, op, wait_s, fail)


def _ring_sum(members: Membership, streams: MessageStreams, t: torch.Tensor, op: str,
              wait_s: float, fail: Callable[[int, PeerError], None]
              ) -> tuple[torch.Tensor, int]:
    right, left = members.nearest_live(1), members.nearest_live(-1)
    kr, kl = members.link_to(right), members.link_to(left)
    cpu = t.detach().to("cpu", copy=True).contiguous()
    me = members.member
    leader = left > me  # the lowest live member: its left wraps around
    last = right < me   # its right is the lowest
    # Beside the sum goes int64 [1 + 2 size]: the count, a 1 for every member someone knows
    # to be lost, and a 1 for every member that took part.
    n = members.size
    lost = torch.zeros(1 + 2 * n, dtype=torch.int64)
    lost[1 + torch.tensor(sorted(members.lost), dtype=torch.int64)] = 1
    lost[1 + n + me] = 1

    def recv(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, info = torch.empty_like(cpu), torch.empty_like(lost)
        err = streams.recv_vector(k, out, wait_s) or streams.recv_vector(k, info, wait_s)
        if err is not None:
            fail(k, err)
            raise err
        return out, info

    def send(k: int, v: torch.Tensor, info: torch.Tensor) -> None:
        streams.send_vector(k, v)
        streams.send_vector(k, info)

    lost[0] = 1
    if leader:
        send(kr, cpu, lost)
        total, info = recv(kl)      # from the last
        send(kr, total, info)       # around the ring, up to the last
    else:
        total, info = recv(kl)
        if op == "max":
            torch.maximum(total, cpu, out=total)
        else:
            total.add_(cpu)
        upstream = int(info[0])
        info = torch.maximum(info, lost)
        info[0] = upstream + 1      # the count: the partial's and this member
        send(kr, total, info)       # the last sends the total to the leader
        if last:
            recv(kl)                # the total, come around: already known here
        else:
            total, info = recv(kl)
            send(kr, total, info)
    members.learn({m for m in range(n) if info[1 + m]},
                  took_part={m for m in range(n) if info[1 + n + m]})
    # a copy: the tensor sent is the streams' until it has left
    return total.to(t.device, copy=True), int(info[0])
