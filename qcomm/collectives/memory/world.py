"""A whole job's ranks in one process: the in-memory world and its groups.

Tests and simulations of every layer (the collectives, the gossip, the averaging engine, the
optimizers) need the collectives' semantics, not sockets. A :class:`MemoryWorld` of
``world_size`` ranks is a :class:`~qcomm.collectives.group.World`, and its :class:`MemoryGroup`
objects are :class:`~qcomm.collectives.group.CommGroup` s: everything that takes a group or a
world takes them, and runs unchanged. A :class:`~qcomm.collectives.topology.Topology` built with
``world=`` uses them for its intra-node groups and rails, one thread per rank::

    world = MemoryWorld(4)

    def body(rank: int) -> float:
        topo = Topology(2, rank=rank, world_size=4, world=world)
        ...                                    # build and drive the engine on `topo`

    results = world.run(body)                  # one thread per rank, results by rank

Two modes. Threaded (the default): each rank is a thread, and every wait blocks until the
peers arrive or ``timeout_s`` passes. Stepped (``clock=`` given): one thread drives every
member in turn (the simulators, :mod:`.simulate`); nothing arrives while a member waits, so a
wait for what is not there fails at once, and a stream message becomes visible
``delay(src, dst)`` clock units after it was sent. A stepped world has point-to-point gossip
only: a collective needs every member inside it at once.

Every collective is synchronous (two barrier waits) and returns a completed work object; a
member that does not arrive within ``timeout_s`` breaks the barrier for everyone and each
waiting member raises :class:`~qcomm.collectives.errors.PeerTimeoutError`;
:meth:`MemoryWorld.abort` breaks every wait at once. The bytes are Gloo's where the tests
compare them: docs/design.md, section "The in-memory world's arithmetic".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.collectives.group import REDUCE_OPS, CommGroup, World
from qcomm.collectives.stats import CommStats
from qcomm.validation import check_choice, check_int, check_timeout

from .streams import Mailboxes, MemoryStreams
from .transport import MemoryHub, MemoryTransport

__all__ = ["MemoryGroup", "MemoryWorld"]

Clock = Callable[[], float]
Delay = Callable[[int, int], float]


class _DoneWork:
    """What an in-memory collective returns: already complete (the call was synchronous)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _DoneWork()


class _SharedGroup:
    """State every member of one in-memory group shares: a barrier and one slot per member
    for the collectives, the gossip's mailboxes."""

    def __init__(self, ranks: tuple[int, ...], timeout_s: float, clock: Clock | None,
                 delay: Delay | None) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.stepped = clock is not None
        self.barrier = threading.Barrier(len(ranks))
        self.slots: list[Any] = [None] * len(ranks)
        # Point-to-point mailboxes for the round-based gossip (waits block between threads).
        self.hub = MemoryHub(len(ranks), blocking=not self.stepped)
        # Ordered streams for the wait-free gossip; the world's delays are by global rank.
        by_member = None if delay is None else (lambda i, j: delay(ranks[i], ranks[j]))
        self.mailboxes = Mailboxes(len(ranks), clock=clock, delay=by_member)

    def abort(self) -> None:
        self.barrier.abort()
        self.hub.abort()
        self.mailboxes.abort()


class MemoryGroup(CommGroup):
    """One member's handle on an in-memory group, as a process group is to one rank.

    Attributes:
        ranks: global ranks of the members, in member order.
        rank: this member's index in ``ranks``.
        size: number of members.
        hub: the group's mailboxes for the round-based gossip.
        mailboxes: the group's queues for the wait-free gossip's streams (a test may
            :meth:`~.streams.Mailboxes.kill` a member there: its connections break).
    """

    def __init__(self, shared: _SharedGroup, rank: int) -> None:
        self._shared = shared
        self.ranks = list(shared.ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.hub = shared.hub
        self.mailboxes = shared.mailboxes

    # -----------------------------------------------------------------------------------------

    def _exchange(self, value: Any, operation: str) -> list[Any]:
        """Deposit ``value``, wait for every member's, return them all in member order."""
        sh = self._shared
        if sh.stepped and self.size > 1:
            raise RuntimeError(f"in-memory {operation}: a stepped world has no collectives "
                               "(one thread drives every member, and a collective needs all "
                               "of them inside it at once)")
        sh.slots[self.rank] = value
        self._barrier(operation)
        values = list(sh.slots)
        self._barrier(operation)  # nobody overwrites a slot before everyone has read it
        return values

    def _barrier(self, operation: str) -> None:
        try:
            self._shared.barrier.wait(self._shared.timeout_s)
        except threading.BrokenBarrierError:
            raise PeerTimeoutError(f"in-memory {operation} (rank {self.ranks[self.rank]})",
                                   self._shared.timeout_s, self.other_ranks()) from None

    def abort(self) -> None:
        """Break the group's waits: every member waiting in a collective or for a gossip
        message fails at once."""
        self._shared.abort()

    # -----------------------------------------------------------------------------------------
    # the collectives (each synchronous)

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> _DoneWork:
        parts = self._exchange(inp.detach().reshape(-1).clone(), "all_gather")
        torch.cat(parts, out=out.view(-1))
        return DONE

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> _DoneWork:
        parts = self._exchange(inp.detach().reshape(self.size, -1).clone(), "all_to_all")
        out.view(self.size, -1).copy_(torch.stack([p[self.rank] for p in parts]))
        return DONE

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> _DoneWork:
        """As :meth:`CommGroup.all_reduce`, reducing in member order."""
        check_choice("op", op, REDUCE_OPS)
        parts = self._exchange(tensor.detach().clone(), "all_reduce")
        acc = parts[0].clone()
        for p in parts[1:]:
            if op == "sum":
                acc += p
            elif op == "max":
                torch.maximum(acc, p, out=acc)
            else:
                torch.minimum(acc, p, out=acc)
        tensor.copy_(acc)
        return DONE

    def all_reduce_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        self.all_reduce(tensor)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(tensor)
        return done

    def barrier(self) -> None:
        self._exchange(None, "barrier")

    # -----------------------------------------------------------------------------------------
    # point-to-point

    def transport(self, peers: list[int], *, stats: CommStats | None,
                  level: str) -> MemoryTransport:
        return MemoryTransport(self.hub, self.rank, peers, stats, level=level,
                               peer_ranks=[self.ranks[p] for p in peers])

    def streams(self, peers: list[int], *, nbytes: int, max_backlog: int, timeout_s: float,
                stream_end: Callable[[torch.Tensor, int], str | None], stats: CommStats | None,
                level: str) -> MemoryStreams:
        # A goodbye is a None in the queue here, and nothing follows a last message: stream_end
        # is not needed.
        return MemoryStreams(self.mailboxes, self.rank, peers, max_backlog=max_backlog,
                             timeout_s=timeout_s, stats=stats, level=level,
                             peer_ranks=[self.ranks[p] for p in peers])

    def __repr__(self) -> str:
        return f"MemoryGroup(ranks={self.ranks}, rank={self.rank})"


class MemoryWorld(World):
    """``world_size`` ranks living in this process; groups are shared by ranks.

    Args:
        world_size: number of ranks, >= 1.
        timeout_s: how long a wait for the other members lasts before
            :class:`PeerTimeoutError`.
        clock: None: ranks are threads (:meth:`run`). A function returning the current time
            of a simulation: the world is stepped (module docstring).
        delay: with ``clock``, ``delay(src, dst)`` (global ranks, clock units): how long a
            stream message from ``src`` is held back before ``dst`` sees it; None: no delay.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 60.0, clock: Clock | None = None,
                 delay: Delay | None = None) -> None:
        self.world_size = check_int("world_size", world_size, low=1)
        self.timeout_s = check_timeout(timeout_s)
        if delay is not None and clock is None:
            raise ValueError("delay needs a clock: messages are held back in a stepped world "
                             "only")
        self._clock = clock
        self._delay = delay
        self._groups: dict[tuple[int, ...], _SharedGroup] = {}
        self._lock = threading.Lock()

    @property
    def stepped(self) -> bool:
        """True when one thread drives every member (``clock`` was given)."""
        return self._clock is not None

    def group(self, ranks: Sequence[int], rank: int) -> MemoryGroup:
        """Global rank ``rank``'s handle on the group of ``ranks`` (created on first use)."""
        key = tuple(ranks)
        if not key or len(set(key)) != len(key) or not all(
                0 <= r < self.world_size for r in key):
            raise ValueError(f"ranks must be distinct ranks in [0, {self.world_size}), "
                             f"got {list(ranks)}")
        if rank not in key:
            raise ValueError(f"rank {rank} is not a member of {list(ranks)}")
        with self._lock:
            shared = self._groups.get(key)
            if shared is None:
                shared = self._groups[key] = _SharedGroup(key, self.timeout_s, self._clock,
                                                          self._delay)
        return MemoryGroup(shared, key.index(rank))

    # -----------------------------------------------------------------------------------------
    # the World interface (what a Topology asks)

    def job(self, rank: int | None, world_size: int | None) -> tuple[int | None, int | None]:
        if rank is None or world_size is None:
            raise ValueError("rank and world_size must be given with world=")
        if world_size != self.world_size:
            raise ValueError(f"world_size={world_size!r} differs from the in-memory world's "
                             f"{self.world_size}")
        return rank, world_size

    def check(self, rank: int, world_size: int) -> None:
        pass  # job() checked the size, and the groups exist as soon as they are asked for

    def new_groups(self, rank_lists: Sequence[Sequence[int]], rank: int
                   ) -> list[MemoryGroup | None]:
        return [self.group(ranks, rank) if rank in ranks else None for ranks in rank_lists]

    def whole(self, rank: int) -> MemoryGroup:
        return self.group(range(self.world_size), rank)

    def control_device(self) -> torch.device:
        return torch.device("cpu")

    def __repr__(self) -> str:
        mode = ", stepped" if self.stepped else ""
        return f"MemoryWorld({self.world_size}{mode})"

    # -----------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Break every group's waits (a failed rank thread calls this so others stop)."""
        with self._lock:
            for shared in self._groups.values():
                shared.abort()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
        """Run ``fn(rank, *args)`` on one thread per rank; return the results in rank order.

        Raises:
            RuntimeError: a rank raised (the first error is chained; every rank's error is in
                the message) or did not finish within ``timeout_s``.
        """
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank, *args)
            except BaseException as e:  # reported below, with the rank
                errors[rank] = e
                self.abort()  # peers blocked in a collective with us fail now, not at timeout

        threads = [threading.Thread(target=target, args=(r,), daemon=True,
                                    name=f"qcomm-rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        late = [r for r, t in enumerate(threads) if t.is_alive()]
        if late:
            self.abort()
            raise RuntimeError(f"ranks {late} did not finish within {timeout_s:g} s")
        if errors:
            first = min(errors)
            lines = "; ".join(f"rank {r}: {type(e).__name__}: {e}"
                              for r, e in sorted(errors.items()))
            raise RuntimeError(f"in-memory world failed: {lines}") from errors[first]
        return results
