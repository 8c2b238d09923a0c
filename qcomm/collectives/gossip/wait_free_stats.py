"""What the wait-free gossip reports of itself (``opt.stats()``, the engine's report): per live
neighbour its rounds applied and its lag, the live members, the nodes lost and back, the terms
paired and how old the mixed rounds were."""

from __future__ import annotations

from typing import Any

__all__ = ["idle_wait_free_stats", "wait_free_stats"]


def wait_free_stats(gossip: Any) -> dict[str, Any]:
    """The statistics of a :class:`~.wait_free.WaitFreeGossip` (keys as
    :func:`idle_wait_free_stats`)."""
    return {"rounds_received": gossip.rounds_received(), "lag_rounds": gossip.lag(),
            "live_nodes": gossip.live_members(),
            "dropped_ranks": [e["rank"] for e in gossip.losses],
            "rejoined_ranks": [e["rank"] for e in gossip.membership.returns],
            "terms_paired": dict(gossip.terms),
            "mix_lag_rounds": dict(sorted(gossip.mix_lags.items()))}


def idle_wait_free_stats() -> dict[str, Any]:
    """The statistics before any member exists: a single live node, nothing received."""
    return {"rounds_received": {}, "lag_rounds": {}, "live_nodes": 1, "dropped_ranks": [],
            "rejoined_ranks": [],
            "terms_paired": {"paired": 0, "possible": 0}, "mix_lag_rounds": {}}
