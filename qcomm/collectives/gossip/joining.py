"""A member joining a running wait-free gossip: what it takes from a live neighbour, and how it
starts from it.

The joiner (a new member, or one that was lost and restarted) starts where its neighbour is:
its parameters are the neighbour's (the caller copies them), and so are its gossip clock (steps,
rounds, drains: every member drains at the same points), its
own public copy (the copies its neighbours keep of it start from its hello, which sends that
copy) and its outer step's anchor and momentum; it owes nothing and has no link yet. It then
opens a link to the nearest live member on each side; those members, told of it
(:meth:`.membership.Membership.admit`), retire the link that spanned its gap and open theirs
to it. What a join does to the members' mean: it adds a copy of the neighbour's parameters
(the mean moves by ``(x_neighbour - mean) / (live + 1)``); the mixing moves no mass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import one_peer_joins
from .copies import link_rows
from .join_checks import check_same_gossip

if TYPE_CHECKING:
    from .wait_free import WaitFreeGossip

__all__ = ["admit", "join_state", "offers_state", "start_joined", "start_without"]


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def join_state(g: WaitFreeGossip) -> dict:
    """What a member joining next to ``g`` starts from (module docstring): a dict of ints, the
    members ``g`` knows lost, its config and gamma, and float32 CPU copies of its public copy
    ``[numel]`` and outer anchor and momentum (None without an outer step).

    Raises:
        RuntimeError: ``g`` has not sent a round yet (nothing to start from).
    """
    if g.time_varying:   # the one-peer graph's (.one_peer_joins)
        return one_peer_joins.join_state(g)
    if g._hat_own is None:
        raise RuntimeError("join_state() before this member's first round: a joiner starts "
                           "from a member that has gossiped")
    return {"config": g._config(), "gamma": g.gamma, "steps": g.steps,
            "rounds_started": g.rounds_started, "drains": g.membership.drains,
            "lost": sorted(g.lost),
            "hat_own": _cpu(g._hat_own), "anchor": _cpu(g._anchor),
            "momentum": _cpu(g._momentum)}


def start_joined(g: WaitFreeGossip, state: dict, device: torch.device | str = "cpu") -> None:
    """Start ``g`` as a member joining the running gossip from a neighbour's
    :func:`join_state` ``state`` (its buffers on ``device``), and open its links. Call it
    before ``g``'s first round; every running member is told with :func:`admit`.

    Raises:
        ValueError: ``state`` is not a join state of this gossip (a different config or
            gamma, named); nothing is changed.
        RuntimeError: ``g`` has gossiped already.
    """
    if g.time_varying:
        one_peer_joins.start_joined(g, state, device)
        return
    if not isinstance(state, dict) or "config" not in state or "hat_own" not in state:
        raise ValueError("state must be a dict from WaitFreeGossip.join_state()")
    check_same_gossip(g, state)
    if g._streams is not None or g.rounds_started or g._hat_own is not None:
        raise RuntimeError("start_joined() must come before this member's first round")
    on = lambda t: None if t is None else t.to(device, dtype=torch.float32, copy=True)
    g.steps, g.rounds_started = int(state["steps"]), int(state["rounds_started"])
    g._hat_own = on(state["hat_own"])
    g._anchor, g._momentum = on(state["anchor"]), on(state["momentum"])
    g.membership.start_joining({int(m) for m in state["lost"]}, int(state["drains"]))
    _fresh_links(g)
    g._links.ensure(g.numel, g._hat_own.device)
    g._ledger.owed = torch.zeros_like(g._hat_own)
    g._drained_at = None
    g._apply(g.membership.link_up(g._own()))


def _fresh_links(g: WaitFreeGossip) -> None:
    """``g``'s per-link state anew, for the links its membership holds now."""
    g._links, g._terms, g._ledger = link_rows(g.membership, g._codec, g.fragments,
                                              g.staleness + g.fragments, g.level)


def start_without(g: WaitFreeGossip, absent: set[int]) -> None:
    """Start ``g`` with members ``absent`` not there yet (a job's seats beyond the nodes it
    starts with): its links go to the nearest present members instead
    (:meth:`.membership.Membership.start_without`); an absent member that starts later joins
    as any joiner (:func:`start_joined`, :func:`admit`). Every present member passes the same
    ``absent``, before its first round.

    Raises:
        RuntimeError: ``g`` has gossiped already.
    """
    if g.time_varying:
        one_peer_joins.start_without(g, absent)
        return
    if g._streams is not None or g.rounds_started or g._hat_own is not None:
        raise RuntimeError("start_without() must come before this member's first round")
    g.membership.start_without({int(m) for m in absent})
    _fresh_links(g)


def admit(g: WaitFreeGossip, member: int) -> None:
    """``member`` joins: call it on every running member ``g``
    (:meth:`.membership.Membership.admit`: the ring opens to it next to it; on the one-peer
    graph its peers open new links to it)."""
    if g.time_varying:
        one_peer_joins.admit(g, member)
        return
    g._apply(g.membership.admit(member, g._own()))


def offers_state(g: WaitFreeGossip, member: int) -> bool:
    """Whether running member ``g`` offers its state to ``member`` joining: on a static graph
    its nearest live member below (the ring opens there), on the one-peer graph each of its
    peers (:func:`.one_peer_joins.offers_state`; the rendezvous takes the first offer)."""
    if g.time_varying:
        return one_peer_joins.offers_state(g, member)
    return g.membership.nearest_live(1) == member
