"""The check a joiner's gossip makes of the state a running member handed it, shared by both
wait-free forms (the ring's :mod:`.joining` and the one-peer graph's :mod:`.one_peer_state`)."""

from __future__ import annotations

from typing import Any

__all__ = ["check_same_gossip"]


def check_same_gossip(g: Any, state: dict) -> None:
    """Raise ValueError naming every setting in which the running members' gossip (``state``,
    a join state) differs from ``g``'s, the member's own number aside; the gamma too."""
    mine, theirs = g._config(), dict(state["config"])
    differ = {k: (theirs.get(k), v) for k, v in mine.items()
              if k != "member" and theirs.get(k) != v}
    if float(state["gamma"]) != g.gamma:
        differ["gamma"] = (float(state["gamma"]), g.gamma)
    if differ:
        raise ValueError("the running members' gossip differs from this one's (theirs, "
                         f"this one's): {differ}")
