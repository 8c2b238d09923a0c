"""The named settings the README and the guide recommend, defined once: the bench trains exactly
these (its methods ``slow-link`` and ``adamw-slow-link``), so a table of them measures what
users are told to use.

    from qcomm.sgd import ASSGD, SLOW_LINK
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, **SLOW_LINK)

Each is a read-only mapping of :class:`~qcomm.engine.CommOptions` fields; ``{**SLOW_LINK,
"bits": 4}`` is a variant of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["ADAMW_SLOW_LINK", "SLOW_LINK"]

SLOW_LINK: Mapping[str, Any] = MappingProxyType({
    "bits": 2, "sync_every": 16, "fragments": 4, "gamma": 0.8, "rounding": "nearest",
    "outer_momentum": 0.9, "outer_lr": 0.5, "wait_free": True, "on_peer_loss": "continue"})
"""SGD between nodes over a slow link: 2-bit gossip of one fragment in four every 4 steps, an
outer Nesterov step, no node waiting for another and none ended by a lost neighbour."""

ADAMW_SLOW_LINK: Mapping[str, Any] = MappingProxyType({
    "bits": 4, "sync_every": 2, "fragments": 2, "gamma": 1.0, "rounding": "nearest"})
"""Any torch optimizer (AdamW) between nodes over a slow link: 4-bit gossip of one half of the
parameters every step, in lockstep."""
