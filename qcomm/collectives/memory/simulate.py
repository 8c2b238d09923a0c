"""In-process simulation of a gossip group: n gossip members on one stepped
:class:`~.world.MemoryWorld`, driven in lock step from one thread; the same code path as over
Gloo minus the sockets.

Fast and deterministic: used to measure the default gamma and by the unit tests, which also
check that real multi-process runs give the very same bits.

    sim = GossipSimulator(4, numel=4096, graph="ring", spec=QuantSpec(4, 128, "stochastic"))
    xs = [torch.randn(4096) for _ in range(4)]
    for _ in range(100):
        sim.step(xs)          # every member does one step, in lock step
    print(sim.consensus_distance(xs))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.gossip.graphs import TIME_VARYING_GRAPHS
from qcomm.collectives.gossip.joining import admit, join_state, start_joined
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.gossip.schedules import check_any_graph
from qcomm.collectives.gossip.wait_free import WaitFreeGossip
from qcomm.collectives.stats import CommStats
from qcomm.validation import check_int

from .one_peer import OnePeerBoard, OnePeerMember
from .world import MemoryWorld

__all__ = ["GossipSimulator", "WaitFreeSimulator"]


class GossipSimulator:
    """``n`` gossip members (:class:`~qcomm.collectives.gossip.CompressedGossip`) on a stepped
    in-memory world of ``n`` ranks (``self.world``, its clock the steps taken); keyword
    arguments go to CompressedGossip (all but ``stats``: each member gets its own CommStats,
    ``self.stats[i]``).

    A time-varying ``graph`` (``"one-peer-exp"``, :mod:`qcomm.collectives.gossip.schedules`)
    makes the members :class:`~.one_peer.OnePeerMember` s instead (the reference that the
    lockstep OnePeerGossip matches bit for bit), exchanging through a shared dict rather than
    the world's transport; they take ``spec`` (None: no compression), ``gamma``,
    ``staleness`` and ``seed``; :meth:`lose` takes a member out of their schedule.
    """

    def __init__(self, n: int, numel: int, *, graph: str = "ring", **kwargs) -> None:
        check_any_graph(graph)
        self.n = n
        self.steps = 0
        self.lost: set[int] = set()
        self.world = MemoryWorld(n, clock=lambda: float(self.steps))
        ranks = list(range(n))
        self.stats = [CommStats() for _ in range(n)]
        self.members: list[CompressedGossip] | list[OnePeerMember]
        if graph in TIME_VARYING_GRAPHS:
            self.board: OnePeerBoard = {}
            self.members = [OnePeerMember(i, n, numel, self.board, stats=self.stats[i],
                                          **kwargs) for i in range(n)]
            return
        self.members = [
            CompressedGossip(ranks, self.world.group(ranks, i), numel, graph=graph,
                             stats=self.stats[i], **kwargs)
            for i in range(n)
        ]

    def step(self, xs: list[torch.Tensor]) -> None:
        """One step of every member on its ``xs[i]`` (float32 ``[numel]``, updated in place):
        everyone starts the round, then everyone applies and mixes (so staleness 0 works)."""
        live = [(m, x) for i, (m, x) in enumerate(zip(self.members, xs, strict=True))
                if i not in self.lost]
        for m, x in live:
            m.begin(x)
        for m, x in live:
            m.finish(x)
        self.steps += 1

    def lose(self, i: int) -> None:
        """Member i is lost before the next step: it steps no more, and the one-peer schedule
        runs over the others from then on (:meth:`~.one_peer.OnePeerMember.set_live`); its
        ``xs[i]`` is left as it was. Only on a time-varying graph (the static members do not
        survive a loss in lock step; :class:`WaitFreeSimulator` loses members on those)."""
        if not hasattr(self, "board"):
            raise ValueError("lose() needs graph='one-peer-exp': the lockstep static members "
                             "do not go on without a member (WaitFreeSimulator's do)")
        check_int("i", i, low=0, high=self.n, high_open=True)
        self.lost.add(i)
        live = [j for j in range(self.n) if j not in self.lost]
        for j in live:
            self.members[j].set_live(live)

    @staticmethod
    def consensus_distance(xs: list[torch.Tensor]) -> float:
        """``sqrt(mean_i ||x_i - mean x||^2)`` in float64 (as
        :func:`~qcomm.collectives.gossip.consensus_distance`,
        same operation order, so the numbers match the distributed one)."""
        v = torch.stack([x.reshape(-1).to(torch.float64) for x in xs])
        mean = v.sum(dim=0) / len(xs)
        return math.sqrt(float(((v - mean) ** 2).sum()) / len(xs))


class WaitFreeSimulator:
    """``n`` wait-free gossip members (:class:`~qcomm.collectives.gossip.WaitFreeGossip`) on a
    stepped in-memory world whose clock counts ticks: member i takes one local step every
    ``periods[i]`` ticks (5 = five times slower than a member with 1), and a message from i to
    j becomes visible ``delay(i, j)`` ticks after it was sent. Deterministic: the same
    arguments give the same bits.

    A member whose round would exceed ``max_backlog`` messages not yet taken by a neighbour
    stalls (takes no step) until that neighbour has taken one, as a real sender waits.

        sim = WaitFreeSimulator(4, numel=4096, periods=[5, 1, 1, 1])
        xs = [torch.randn(4096) for _ in range(4)]
        sim.run(xs, ticks=200)          # member 0 takes 40 steps, the others 200
        sim.drain()                     # every message delivered and applied
        sim.kill(2); sim.run(xs, 50); sim.join(2, xs)   # lost, then back: the ring opens

    Keyword arguments go to WaitFreeGossip (``round_period``, ``gamma``, ``fragments``, ...);
    ``graph="one-peer-exp"`` makes the members
    :class:`~qcomm.collectives.gossip.one_peer_wait_free.OnePeerWaitFree` s.
    """

    def __init__(self, n: int, numel: int, *, graph: str = "ring",
                 periods: list[int] | None = None, delay: int | Callable[[int, int], int] = 0,
                 max_backlog: int = 64, **kwargs) -> None:
        check_any_graph(graph)
        self.n = n
        self.periods = list(periods) if periods is not None else [1] * n
        if len(self.periods) != n or not all(isinstance(p, int) and p >= 1
                                             for p in self.periods):
            raise ValueError(f"periods must be {n} ints >= 1, got {periods!r}")
        self.now = 0.0
        delay_fn = delay if callable(delay) else (lambda i, j: float(delay))
        self.world = MemoryWorld(n, clock=lambda: self.now, delay=delay_fn)
        ranks = list(range(n))
        self._groups = [self.world.group(ranks, i) for i in range(n)]
        self.boxes = self._groups[0].mailboxes  # the group's queues, shared by every member
        self.stats = [CommStats() for _ in range(n)]
        cls = OnePeerWaitFree if graph in TIME_VARYING_GRAPHS else WaitFreeGossip
        self._make = lambda i: cls(ranks, self._groups[i], numel, graph=graph,
                                              stats=self.stats[i], max_backlog=max_backlog,
                                              **kwargs)
        self.members = [self._make(i) for i in range(n)]
        self.stalled_ticks = [0] * n
        self.killed: set[int] = set()

    def kill(self, i: int) -> None:
        """Member i dies now: it takes no more steps; what it sent stays on the wire, then its
        streams fail as broken connections."""
        self.killed.add(i)
        self.boxes.kill(i)

    def join(self, i: int, xs: list[torch.Tensor], donor: int | None = None) -> None:
        """Killed member i starts again now and joins the running gossip (a fresh
        :class:`WaitFreeGossip`, started from ``donor``'s :func:`~qcomm.collectives.gossip.
        joining.join_state`; ``xs[i]`` becomes a copy of ``xs[donor]``); every live member is
        told (:func:`~qcomm.collectives.gossip.joining.admit`). ``donor``: the nearest live
        member below i (cyclic) when None."""
        if i not in self.killed:
            raise ValueError(f"member {i} is running: only a killed member can join")
        live = [j for j in range(self.n) if j not in self.killed]
        if donor is None:
            donor = max((j for j in live if j < i), default=max(live))
        if donor not in live:
            raise ValueError(f"donor must be a live member, got {donor}")
        self.boxes.revive(i)
        self.killed.discard(i)
        joiner = self._make(i)
        start_joined(joiner, join_state(self.members[donor]), xs[i].device)
        xs[i].copy_(xs[donor])
        self.members[i] = joiner
        for j in live:
            admit(self.members[j], i)

    def _blocked(self, i: int) -> bool:
        m = self.members[i]
        return m.round_due() and m._streams_now().blocked()

    def tick(self, xs: list[torch.Tensor],
             update: Callable[[int, torch.Tensor, int], None] | None = None) -> None:
        """One tick: every member whose period divides the tick takes one step: receive
        (prepare), ``update(i, xs[i], step)`` (the local update, in place), round (end_step)."""
        t = int(self.now)
        for i, (m, x) in enumerate(zip(self.members, xs, strict=True)):
            if t % self.periods[i] or i in self.killed:
                continue
            if self._blocked(i):
                self.stalled_ticks[i] += 1
                continue
            m.prepare()
            if update is not None:
                update(i, x, m.steps)
            m.end_step(x)
        self.now += 1

    def run(self, xs: list[torch.Tensor], ticks: int,
            update: Callable[[int, torch.Tensor, int], None] | None = None) -> None:
        """``ticks`` ticks (see :meth:`tick`)."""
        for _ in range(ticks):
            self.tick(xs, update)

    def drain(self) -> None:
        """Deliver every message sent and apply it (what the engine does before the exact
        average)."""
        now, self.now = self.now, float("inf")
        live = [m for i, m in enumerate(self.members) if i not in self.killed]
        for m in live:
            m.send_marker()
        for m in live:
            m.await_markers()
        self.now = now

    def load_state_dicts(self, states: list[dict | None]) -> None:
        """Load every member's :meth:`~qcomm.collectives.gossip.WaitFreeGossip.state_dict`
        (None: a member lost before the save, killed here too); each member then opens streams
        to the neighbours it saved. A simulator of the survivors only loads the states of a
        larger one that lost members: they go on under their old numbers."""
        for i, (m, st) in enumerate(zip(self.members, states, strict=True)):
            if st is None:
                self.kill(i)
                continue
            m._streams = None  # streams a tick opened: the loaded neighbours get new ones
            m.load_state_dict(st)

    consensus_distance = staticmethod(GossipSimulator.consensus_distance)
