"""The settings of a gossip member, in one frozen dataclass: :class:`GossipConfig`.

This is the one place their list is written. :class:`~.choco.CompressedGossip` and
:class:`~.wait_free.WaitFreeGossip` take one (or its fields as keywords), the engine builds
one from its ``CommOptions`` (:meth:`qcomm.engine.CommOptions.gossip_config`) and
:func:`~.factory.build_gossip` picks the member's class from it. The values are checked where
they are used, by a member's constructor, with the functions of :mod:`.options`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from qcomm.compress import QuantSpec

__all__ = ["GossipConfig"]


@dataclass(frozen=True)
class GossipConfig:
    """How a member gossips (the same on every member of a group).

    Attributes:
        spec: the codec's QuantSpec for every message.
        graph: ``"ring"``, ``"exponential"`` or ``"complete"`` (:mod:`.graphs`), or
            ``"one-peer-exp"`` (:mod:`.schedules`; the lockstep OnePeerGossip only). The
            engine's ``CommOptions(graph=None)`` fills it in by the node count
            (:mod:`.graph_choice`).
        mixing: ``"uniform"`` or ``"metropolis"`` (:mod:`.mixing`; equal on these graphs).
        gamma: consensus step in (0, 1]; None: :func:`~.gamma.default_gamma` (bits,
            staleness).
        staleness: tau >= 0. Bounded staleness: round t is applied when round t + tau starts
            (0: synchronous). Wait-free: rounds by which the member's own copy in the mixing
            lags its fresh copy (the delay its messages are expected to take).
        timeout_s: > 0. Bounded staleness: how long to wait for a round before
            :class:`~qcomm.collectives.errors.PeerTimeoutError`. Wait-free: silence after which
            a neighbour's stream fails.
        fragments: F >= 1 dividing the member's ``numel``: round t carries only fragment
            ``t % F``, so each fragment is gossiped every F rounds and every message has the
            same length. Staleness counts rounds of any fragment.
        round_period: steps per round (``sync_every / fragments``), >= 1.
        outer_momentum, outer_lr: an outer Nesterov step on each fragment's own progress since
            its previous round, as DiLoCo and SlowMo take on their averaged deltas
            (:meth:`~.member.GossipMember._mix_fragment`); 0 and 1 (default) are plain CHOCO.
        total_steps: the run's length in local steps, or None: the outer lr is held for its
            first 30%, then anneals to ``min(outer_lr, 1 - outer_momentum)`` at its end
            (:mod:`.outer_anneal`), by the job's progress
            (:meth:`~.member.GossipMember.progress`).
        wait_free: False: bounded staleness (:class:`~.choco.CompressedGossip`); True: no
            member waits for a neighbour's round (:class:`~.wait_free.WaitFreeGossip`). Read by
            :func:`~.factory.gossip_class` only.
        max_backlog: wait-free: messages per neighbour sent and not yet taken, >= 1.
        on_peer_loss: wait-free: ``"raise"`` a neighbour's failure, or ``"continue"`` without
            it (:mod:`.wait_free`).
    """

    spec: QuantSpec = QuantSpec(4, 128, "stochastic")  # noqa: RUF009 (frozen)
    graph: str = "ring"
    mixing: str = "uniform"
    gamma: float | None = None
    staleness: int = 1
    timeout_s: float = 300.0
    fragments: int = 1
    round_period: int = 1
    outer_momentum: float = 0.0
    outer_lr: float = 1.0
    total_steps: int | None = None
    wait_free: bool = False
    max_backlog: int = 64
    on_peer_loss: str = "raise"

    @classmethod
    def of(cls, config: GossipConfig | None, settings: dict[str, Any]) -> GossipConfig:
        """``config`` (None: the defaults) with the fields named in ``settings`` replaced: what
        a member's constructor takes (its keywords override the config's fields).

        Raises:
            TypeError: ``config`` is not a GossipConfig, or a name in ``settings`` is not a
                field (named, with the fields).
        """
        if config is not None and not isinstance(config, GossipConfig):
            raise TypeError(f"config must be a GossipConfig (or None), got "
                            f"{type(config).__name__}")
        names = sorted(f.name for f in fields(cls))
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"unknown gossip setting {unknown[0]!r}; accepted: "
                            f"{', '.join(names)}")
        base = config if config is not None else cls()
        return replace(base, **settings) if settings else base
