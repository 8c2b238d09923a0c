"""Saved and join states of :class:`~.one_peer_wait_free.OnePeerWaitFree`: what a checkpoint
holds (every live link's copies and counts, after a drain) and the checks before anything of
a saved or join state is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qcomm.compress import WIRE_FORMAT_VERSION
from qcomm.validation import check_seed

from .codec import check_state_buffer
from .join_checks import check_same_gossip

if TYPE_CHECKING:
    from .one_peer_wait_free import OnePeerWaitFree

__all__ = ["check_join_state", "links_state", "load_links_state"]


def links_state(g: OnePeerWaitFree) -> dict:
    """``g``'s state: ``{"config", "wire_format", "gamma", "seed", "steps",
    "rounds_started", "drains", "lost", "losses", "links": [per live link: peer, fresh and
    theirs (float32 [numel]), counts, own messages not acknowledged], "owed", "momentum",
    "anchor" (float32 [numel] or None)}``."""
    return {"config": g._config(), "wire_format": WIRE_FORMAT_VERSION, "gamma": g.gamma,
            "seed": g.seed, "steps": g.steps, "rounds_started": g.rounds_started,
            "drains": g._drains, "lost": sorted(g.lost), "losses": list(g.losses),
            "links": [g.links[p].state() for p in g.live_links()], "owed": g._owed,
            "momentum": g._momentum, "anchor": g._anchor}


def load_links_state(g: OnePeerWaitFree, state: object) -> None:
    """Load a :func:`links_state` into ``g`` before its first round; everything is checked
    before anything is loaded (ValueError naming what differs)."""
    if not isinstance(state, dict) or "links" not in state or "config" not in state:
        raise ValueError("state must be a dict from OnePeerWaitFree.state_dict()")
    if state["config"] != g._config():
        raise ValueError(f"state was saved with config {state['config']}, this gossip has "
                         f"{g._config()}")
    if state.get("wire_format") != WIRE_FORMAT_VERSION:
        raise ValueError(f"state holds messages in wire format {state.get('wire_format')}; "
                         f"this version decodes format {WIRE_FORMAT_VERSION}")
    if g._streams is not None or g.rounds_started:
        raise RuntimeError("load_state_dict after the first round")
    links = state["links"]
    peers = [int(saved["peer"]) for saved in links]
    if any(p not in g.peers for p in peers):
        raise ValueError(f"state['links'] must be links to this member's peers {g.peers}, "
                         f"got {peers}")
    for i, saved in enumerate(links):
        for name in ("fresh", "theirs"):
            check_state_buffer(f"links[{i}]['{name}']", saved[name], g.numel)
    owed = state["owed"]
    if owed is not None:
        check_state_buffer("owed", owed, g.numel)
    g.gamma = float(state["gamma"])
    g.seed = check_seed(state["seed"])
    g.steps, g.rounds_started = int(state["steps"]), int(state["rounds_started"])
    g._drains = int(state["drains"])
    g.lost = {int(m) for m in state["lost"]}
    g.losses = [dict(e) for e in state["losses"]]
    copy = lambda t: None if t is None else t.detach().clone()
    g._momentum, g._anchor = copy(state["momentum"]), copy(state["anchor"])
    g._open = peers
    if owed is None:
        return   # saved before the first round
    g._ensure(owed.device)
    g._owed.copy_(owed)
    for saved in links:
        link = g.links[int(saved["peer"])]
        link.restore(saved)
        link.markers = 0   # markers restart with the streams
    g._drains = 0
    g._drained_at = g.rounds_started


def check_join_state(g: OnePeerWaitFree, state: object) -> None:
    """Raise ValueError unless ``state`` is a join state of ``g``'s gossip (the same config
    but the member, the same gamma), RuntimeError when ``g`` has gossiped already."""
    if not isinstance(state, dict) or "config" not in state or "lost" not in state:
        raise ValueError("state must be a dict from OnePeerWaitFree.join_state()")
    check_same_gossip(g, state)
    if g._streams is not None or g.rounds_started or g._owed is not None:
        raise RuntimeError("start_joined() must come before this member's first round")
