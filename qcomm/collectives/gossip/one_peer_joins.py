"""Members that come and go in the wait-free gossip on the one-peer graph
(:class:`~.one_peer_wait_free.OnePeerWaitFree`): what a joiner starts from, how it starts, how
the running members let it in, and seats not taken at the start. :mod:`.joining` hands a
one-peer member's joins to these functions.

The schedule keeps the members' numbers, so a join changes no pairing: the joiner's peers open
new links to it (both copies from zero: exact at both ends without a hello), and it opens its
links to its live peers; the rounds with a member that is lost or absent are sat out.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .one_peer_state import check_join_state

if TYPE_CHECKING:
    from .one_peer_wait_free import OnePeerWaitFree

__all__ = ["admit", "join_state", "offers_state", "start_joined", "start_without"]


def join_state(g: OnePeerWaitFree) -> dict:
    """What a member joining next to ``g`` starts from: ``g``'s config and gamma, its clock
    (steps, rounds, drains: every member drains at the same points), the members it knows
    lost, and float32 CPU copies of its outer step's anchor and momentum (None without)."""
    cpu = lambda t: None if t is None else t.detach().to("cpu", copy=True)
    return {"config": g._config(), "gamma": g.gamma, "steps": g.steps,
            "rounds_started": g.rounds_started, "drains": g._drains, "lost": sorted(g.lost),
            "anchor": cpu(g._anchor), "momentum": cpu(g._momentum)}


def start_joined(g: OnePeerWaitFree, state: dict, device: torch.device | str = "cpu") -> None:
    """Start ``g`` from a live member's :func:`join_state` (before its first round): its
    clock and lost members, links to its live peers from zero (buffers on ``device``).

    Raises:
        ValueError: ``state`` is not a join state of this gossip (what differs, named).
        RuntimeError: ``g`` has gossiped already.
    """
    check_join_state(g, state)
    on = lambda t: None if t is None else t.to(device, dtype=torch.float32, copy=True)
    g.steps, g.rounds_started = int(state["steps"]), int(state["rounds_started"])
    g._drains = int(state["drains"])
    g.lost = {int(m) for m in state["lost"]} - {g.member}
    g._anchor, g._momentum = on(state["anchor"]), on(state["momentum"])
    g._open = [p for p in g.peers if p not in g.lost]
    g._ensure(torch.device(device))
    for link in g.links.values():
        link.markers = g._drains   # its peers count markers from the same drains
    g._streams_now()   # its links now, while its peers (told by the rendezvous) make theirs


def admit(g: OnePeerWaitFree, member: int) -> None:
    """``member`` joins (again: a new process, or first: a seat taken late); call it on every
    running member. A peer of it drops the link to its old process, when still live, and opens
    a new one, both copies from zero."""
    if not 0 <= member < g.size or member == g.member:
        raise ValueError(f"member must be another member of the {g.size}, got {member}")
    if any(e["member"] == member for e in g.losses):
        g.returns.append({"rank": g.group_ranks[member], "member": member, "step": g.steps,
                          "time": time.time()})
    g.lost.discard(member)
    if member not in g.peers:
        return
    if g._streams is None:   # no stream yet: opened with the others at the first send
        if member not in g._open:
            g._open.append(member)
        if g._owed is not None and member not in g.links:   # links made, streams not yet
            g._new_link(member)
        return
    old = g.links.get(member)
    if old is not None and old.live:
        old.live = False
        g._streams.drop(g._k(member))
    g._stream_peer.append(member)
    k = g._streams.open(member, g.group_ranks[member])
    assert k == len(g._stream_peer) - 1, "streams and links disagree on the count"
    link = g._new_link(member)
    link.markers = g._drains   # the joiner counts its markers from the same drains


def offers_state(g: OnePeerWaitFree, member: int) -> bool:
    """Whether ``g`` offers its state to ``member`` joining: every peer of it does (the
    rendezvous takes the first offer), so an offer comes while any of them is live."""
    return member in g.peers


def start_without(g: OnePeerWaitFree, absent: set[int]) -> None:
    """Start ``g`` with members ``absent`` not there yet (seats a job may grow into): no link
    to them, their rounds sat out, until they join (:func:`admit`). Before the first round.

    Raises:
        RuntimeError: ``g`` has gossiped already.
    """
    if g._streams is not None or g.rounds_started or g._owed is not None:
        raise RuntimeError("start_without() must come before this member's first round")
    g.lost = {int(m) for m in absent} - {g.member}
    g._open = [p for p in g.peers if p not in g.lost]
