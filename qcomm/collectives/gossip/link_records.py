"""The records a wait-free member's membership (:mod:`.membership`) keeps and hands back: one
per link (who is at its other end, how the link stands), what a step of the membership protocol
changed of the links (for the gossip to apply to its own per-link state), and what such a step
needs of the gossip (its clock and public copy, sent in a hello).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Link", "LinkChanges", "OwnState"]


@dataclass(slots=True)
class Link:
    """One link of a member, at index k of its membership's links (its stream and its rows of
    per-link state in the gossip have the same index)."""

    peer: int               # the member at the other end (its number)
    rank: int               # that member's global rank
    live: bool = True       # not dropped (its neighbour not lost, the link not closed)
    greeted: bool = True    # the neighbour's copy is set up (a link opened later: its hello)
    retiring: bool = False  # own retire sent: no own term is added on it any more
    markers: int = 0        # drain markers received on it


@dataclass
class LinkChanges:
    """What a step of the membership protocol did to the links, in order: ``opened`` (new
    links, each at the end, waiting for its neighbour's hello) and ``dropped`` (nothing more of
    them is applied). A link opened and dropped in one step is in both. The gossip applies
    them to its per-link state, the opened ones first (the rows of different links are
    independent, and a link's row exists before it is forgotten)."""

    opened: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)

    def __iadd__(self, other: LinkChanges) -> LinkChanges:
        self.opened += other.opened
        self.dropped += other.dropped
        return self


@dataclass(frozen=True)
class OwnState:
    """What a step of the membership protocol needs of the gossip at the time of the call:
    its clock (``steps``, ``rounds_started``: a loss's record, a hello's round count) and its
    public copy (float32 ``[numel]``, a reference; None before its first round: a hello sends
    zeros)."""

    steps: int
    rounds_started: int
    hat_own: torch.Tensor | None
