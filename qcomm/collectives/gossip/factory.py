"""The gossip member for a mode: the one place that picks :class:`~.choco.CompressedGossip`
(bounded staleness, lockstep; :class:`~.one_peer_choco.OnePeerGossip` on a time-varying
graph) or :class:`~.wait_free.WaitFreeGossip` (:class:`~.one_peer_wait_free.OnePeerWaitFree`
on a time-varying graph) from a :class:`~.config.GossipConfig`.

Whoever holds a member asks it, never its mode: both classes answer the same calls
(:class:`~.member.GossipMember`: ``lockstep``, ``leave``, ``before_state_dict``,
``mode_stats``, ``idle_stats``, ``mode_words``, and the step's ``prepare``, ``end_step``,
``flush``, ``settle``, ``state_dict``).
"""

from __future__ import annotations

from typing import Any

from .choco import CompressedGossip
from .clock import StepClock
from .config import GossipConfig
from .graphs import TIME_VARYING_GRAPHS
from .member import GossipMember
from .one_peer_choco import OnePeerGossip
from .one_peer_wait_free import OnePeerWaitFree
from .wait_free import WaitFreeGossip

__all__ = ["build_gossip", "gossip_class", "mode_class"]


def gossip_class(config: GossipConfig) -> type[GossipMember]:
    """The member class of ``config``'s mode and graph (also before any member exists: its
    class-level answers, ``lockstep``, ``idle_stats`` and ``mode_words``, need none)."""
    one_peer = config.graph in TIME_VARYING_GRAPHS
    if config.wait_free:
        return OnePeerWaitFree if one_peer else WaitFreeGossip
    return OnePeerGossip if one_peer else CompressedGossip


def mode_class(wait_free: bool) -> type[GossipMember]:
    """The class whose class-level answers (``lockstep``, ``idle_stats``, ``mode_words``) are
    the mode's, whatever the graph: what the engine asks before the node count, and with it
    a graph chosen by the count, is known. :class:`~.one_peer_choco.OnePeerGossip` derives
    from :class:`~.choco.CompressedGossip` and answers them alike."""
    return WaitFreeGossip if wait_free else CompressedGossip


def build_gossip(config: GossipConfig, group_ranks: list[int], group: Any, numel: int, *,
                 stats: Any = None, seed: int = 0, clock: StepClock | None = None
                 ) -> GossipMember:
    """One member of the gossip of ``config``'s mode, which makes its own transport (the
    lockstep one) or streams (the wait-free one) from ``group``.

    Args:
        config: the settings, the mode among them.
        group_ranks: the members' global ranks (a rail), in node order.
        group: their group (a :class:`~qcomm.collectives.group.CommGroup`, a process group,
            or None: the default group).
        numel: floats the member gossips (float32 ``[numel]``, its shard), >= 1.
        stats: a :class:`~qcomm.collectives.stats.CommStats` that counts its bytes, or None.
        seed: the member's seed of stochastic rounding.
        clock: the step clock it advances (shared with the caller), or None: its own from 0.

    Returns:
        The member; its constructor communicates nothing.
    """
    return gossip_class(config)(group_ranks, group, numel, config, stats=stats, seed=seed,
                                clock=clock)
