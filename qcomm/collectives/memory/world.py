"""In-process stand-ins for process groups: a whole job's ranks as threads of one process.

Tests and simulations of the layers above (the averaging engine, the optimizers) need the
collectives' semantics, not sockets. A :class:`MemoryWorld` of ``world_size`` ranks hands out
:class:`MemoryGroup` objects that the functions of :mod:`qcomm.collectives.primitives` accept
wherever they accept a ``torch.distributed`` process group, and the gossip transport turns
into an in-memory mailbox (:class:`~qcomm.collectives.gossip.transport.MemoryHub`). A
:class:`~qcomm.collectives.topology.Topology` built with ``world=`` uses them for its intra-node
groups and rails, so the code above it runs unchanged, one thread per rank::

    world = MemoryWorld(4)

    def body(rank: int) -> float:
        topo = Topology(2, rank=rank, world_size=4, world=world)
        ...                                    # build and drive the engine on `topo`

    results = world.run(body)                  # one thread per rank, results by rank

Arithmetic is the same as over Gloo where the tests compare bytes: all-gather and all-to-all
copy, so what is computed from their output is identical; :meth:`MemoryGroup.all_reduce` sums
in member order, which equals Gloo's result bit for bit for two members (``a + b``) and is a
fixed, documented order for more.

Every collective is synchronous (two barrier waits) and returns a completed work object; a
member that does not arrive within ``timeout_s`` breaks the barrier for everyone and each
waiting member raises :class:`~qcomm.collectives.errors.PeerTimeoutError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.validation import check_choice, check_int, check_timeout

__all__ = ["MemoryGroup", "MemoryWorld"]

REDUCE_OPS = ("sum", "max", "min")


class _DoneWork:
    """What an in-memory collective returns: already complete (the call was synchronous)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _DoneWork()


class _SharedGroup:
    """State every member of one in-memory group shares: a barrier and one slot per member."""

    def __init__(self, ranks: tuple[int, ...], timeout_s: float) -> None:
        from qcomm.collectives.gossip.streams import Mailboxes
        from qcomm.collectives.gossip.transport import MemoryHub

        self.ranks = ranks
        self.timeout_s = timeout_s
        self.barrier = threading.Barrier(len(ranks))
        self.slots: list[Any] = [None] * len(ranks)
        # Point-to-point mailboxes for gossip between the members (blocking waits: threads).
        self.hub = MemoryHub(len(ranks), blocking=True)
        # Ordered streams between the members (wait-free gossip).
        self.mailboxes = Mailboxes(len(ranks))


class MemoryGroup:
    """One member's handle on an in-memory group, as a ProcessGroup is to one rank.

    Attributes:
        ranks: global ranks of the members, in member order.
        rank: this member's index in ``ranks``.
        size: number of members.
        hub: the group's point-to-point mailboxes (gossip transport).
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
        sh.slots[self.rank] = value
        self._barrier(operation)
        values = list(sh.slots)
        self._barrier(operation)  # nobody overwrites a slot before everyone has read it
        return values

    def _barrier(self, operation: str) -> None:
        try:
            self._shared.barrier.wait(self._shared.timeout_s)
        except threading.BrokenBarrierError:
            others = [r for i, r in enumerate(self.ranks) if i != self.rank]
            raise PeerTimeoutError(f"in-memory {operation} (rank {self.ranks[self.rank]})",
                                   self._shared.timeout_s, others) from None

    def abort(self) -> None:
        """Break the group's barrier: every member waiting in a collective raises at once."""
        self._shared.barrier.abort()

    # -----------------------------------------------------------------------------------------
    # the collectives the primitives dispatch to (each synchronous)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> _DoneWork:
        """``out`` (flat, ``size * inp.numel()``) = every member's ``inp``, by member."""
        parts = self._exchange(inp.detach().reshape(-1).clone(), "all_gather")
        torch.cat(parts, out=out.view(-1))
        return DONE

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> _DoneWork:
        """Equal splits: chunk k of ``out`` = chunk ``self.rank`` of member k's ``inp``."""
        parts = self._exchange(inp.detach().reshape(self.size, -1).clone(), "all_to_all")
        out.view(self.size, -1).copy_(torch.stack([p[self.rank] for p in parts]))
        return DONE

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> _DoneWork:
        """``tensor`` = the reduction of every member's ``tensor`` (sum in member order)."""
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

    def barrier(self) -> None:
        """Wait until every member arrived."""
        self._exchange(None, "barrier")

    def __repr__(self) -> str:
        return f"MemoryGroup(ranks={self.ranks}, rank={self.rank})"


class MemoryWorld:
    """``world_size`` ranks living as threads of this process; groups are shared by ranks.

    Args:
        world_size: number of ranks, >= 1.
        timeout_s: how long a collective waits for the other members before
            :class:`PeerTimeoutError`.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 60.0) -> None:
        self.world_size = check_int("world_size", world_size, low=1)
        self.timeout_s = check_timeout(timeout_s)
        self._groups: dict[tuple[int, ...], _SharedGroup] = {}
        self._lock = threading.Lock()

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
                shared = self._groups[key] = _SharedGroup(key, self.timeout_s)
        return MemoryGroup(shared, key.index(rank))

    def abort(self) -> None:
        """Break every group's barrier (a failed rank thread calls this so others stop)."""
        with self._lock:
            for shared in self._groups.values():
                shared.barrier.abort()
                shared.hub.abort()
                shared.mailboxes.abort()

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
