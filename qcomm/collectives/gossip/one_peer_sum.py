"""The exact sum over the live members of a wait-free gossip on the one-peer graph, by flooding
its links: what :meth:`~.one_peer_wait_free.OnePeerWaitFree.survivors_sum` runs (the static
graphs' sum runs along their closed ring, :mod:`.survivors`; the one-peer graph keeps none).

In each of ``size - 1`` rounds (the longest path a connected graph of that many members can
have, the same count on every member) a member sends each live peer the members' vectors it
holds and has not sent it yet, with the members it knows to be lost, and takes what each live
peer sent. Once every live member's vector has reached every other, each sums them in member
order: the same bits everywhere. Bytes: every member receives every live member's vector once
per link that brings it first, as an all-gather does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcomm.collectives.errors import PeerError
from qcomm.collectives.links import MessageStreams

__all__ = ["flood_sum"]


def flood_sum(member: int, size: int, links: Callable[[], list[tuple[int, int]]],
              streams: MessageStreams, t: torch.Tensor, op: str, lost: set[int],
              wait_s: float, fail: Callable[[int, PeerError], None]
              ) -> tuple[torch.Tensor, int, set[int]]:
    """The sum (``op="max"``: element-wise maximum) of ``t`` (any dtype and shape) over the
    live members, their count, and the members someone knows to be lost. Collective over the
    live members.

    Args:
        member, size: this member's number and the group's size.
        links: the live links now, as ``(peer, stream index)`` pairs.
        streams: the member's message streams (their vector channel carries the sum).
        lost: the members this member knows to be lost.
        wait_s: how long to wait for each peer's part of a round.
        fail: called with a peer and its error when its part does not come (before the error
            is raised).

    Raises:
        PeerError: a member was lost during the sum (nothing is returned; another call sums
            the remaining members).
    """
    cpu = t.detach().to("cpu", copy=True).contiguous()
    known: dict[int, torch.Tensor] = {member: cpu}
    told: set[int] = set(lost)
    sent: dict[int, set[int]] = {}
    for _ in range(size - 1):
        now = links()
        for peer, k in now:
            new = sorted(set(known) - sent.setdefault(peer, {peer}))
            head = torch.full((1 + 2 * size,), -1, dtype=torch.int64)
            head[0] = len(new)
            head[1:1 + len(new)] = torch.tensor(new, dtype=torch.int64)
            head[1 + size:] = 0
            if told:
                head[1 + size + torch.tensor(sorted(told), dtype=torch.int64)] = 1
            streams.send_vector(k, head)
            for m in new:
                streams.send_vector(k, known[m])
            sent[peer] |= set(new)
        for peer, k in now:
            head = torch.empty(1 + 2 * size, dtype=torch.int64)
            err = streams.recv_vector(k, head, wait_s)
            for m in head[1:1 + max(0, int(head[0]))].tolist() if err is None else ():
                v = torch.empty_like(cpu)
                err = streams.recv_vector(k, v, wait_s)
                if err is not None:
                    break
                known.setdefault(int(m), v)
                sent[peer].add(int(m))   # it has it: not sent back
            if err is not None:
                fail(peer, err)
                raise err
            told |= {int(m) for m in head[1 + size:].nonzero().view(-1)}
    total = None
    for m in sorted(known):   # member order: the same bits on every member
        v = known[m]
        if total is None:
            total = v.clone()
        elif op == "max":
            torch.maximum(total, v, out=total)
        else:
            total.add_(v)
    return total.to(t.device, copy=True), len(known), told - set(known)
