"""What the layers above ask of a group of ranks, and of the world their groups come from.

Every collective of this package, every gossip member and the engine talk to their peers
through a :class:`CommGroup`: who the members are, the three collectives the pipelines are
built from, a barrier, and factories for the two ways gossip moves messages (one payload per
round and ordered streams, :mod:`.links`; over Gloo, :mod:`.gloo`). A :class:`World` says who
this process is and creates a job's groups.

Two implementations stand behind these interfaces, and nothing above them knows which one it
got: :mod:`.torch_group` (``torch.distributed`` process groups: Gloo, NCCL) and
:mod:`.memory` (a whole job's ranks as threads of one process, or driven step by step from
one thread; tests and simulations). A function that takes a ``group`` accepts a
``CommGroup``, a ``torch.distributed`` process group, or None (the default group), and turns
it into a ``CommGroup`` with :func:`~.torch_group.resolve_group`: a bare handle is
torch.distributed's, and :mod:`.torch_group` wraps it; this module names no implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from qcomm.collectives.links import MessageStreams, Transport
    from qcomm.collectives.stats import CommStats

__all__ = ["REDUCE_OPS", "CommGroup", "Work", "World"]

REDUCE_OPS = ("sum", "max", "min")


class Work(Protocol):
    """A collective in flight, as ``torch.distributed`` returns it with ``async_op=True``."""

    def wait(self, timeout: Any = None) -> Any:
        """Block until done; re-raises the collective's failure."""

    def is_completed(self) -> bool:
        """True when :meth:`wait` would return at once."""


class CommGroup(ABC):
    """One member's handle on a group of ranks.

    Attributes:
        ranks: global ranks of the members, in member order.
        rank: this member's index in ``ranks`` (its group rank).
        size: number of members.
    """

    ranks: list[int]
    rank: int
    size: int

    def other_ranks(self) -> list[int]:
        """Global ranks of the other members (the peers an error names)."""
        return [r for i, r in enumerate(self.ranks) if i != self.rank]

    # -----------------------------------------------------------------------------------------
    # collectives: each posts at once and returns its work (complete already where the group
    # is synchronous); a failure to post raises RuntimeError, a failure in flight comes from
    # the work's wait()

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        """``tensor`` (any shape) = the reduction (``op`` in :data:`REDUCE_OPS`) of every
        member's ``tensor``, in place."""

    @abstractmethod
    def all_reduce_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum ``tensor`` over the members in place; a future completing with ``tensor``."""

    @abstractmethod
    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``out`` (flat, ``size * inp.numel()``, ``inp``'s dtype) = every member's ``inp``,
        by member."""

    @abstractmethod
    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Equal splits: chunk k of ``out`` = chunk ``rank`` of member k's ``inp`` (both flat,
        ``size * c`` elements, one dtype)."""

    def native_reduce_scatter(self, device: torch.device) -> bool:
        """Whether :meth:`reduce_scatter_flat` is the backend's own for tensors on ``device``
        (else a reduce-scatter is an all-to-all whose chunks the caller sums)."""
        return False

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``out`` (``[c]``) = the sum over members of chunk ``rank`` of their ``inp``
        (``[size * c]``). Only where :meth:`native_reduce_scatter` says so."""
        raise NotImplementedError(f"{type(self).__name__} has no native reduce-scatter")

    @abstractmethod
    def barrier(self) -> None:
        """Return once every member has called it."""

    # -----------------------------------------------------------------------------------------
    # point-to-point, for the gossip between the members

    @abstractmethod
    def transport(self, peers: list[int], *, stats: CommStats | None,
                  level: str) -> Transport:
        """This member's round-based exchange with the members ``peers`` (member indices):
        one payload per round to and from each (:class:`~.links.Transport`);
        bytes sent counted in ``stats`` under ``level``."""

    @abstractmethod
    def streams(self, peers: list[int], *, nbytes: int, max_backlog: int, timeout_s: float,
                stream_end: Callable[[torch.Tensor, int], str | None], stats: CommStats | None,
                level: str) -> MessageStreams:
        """This member's ordered message streams to and from ``peers`` (member indices):
        messages of ``nbytes`` bytes, at most ``max_backlog`` per neighbour not yet taken, a
        stream silent for ``timeout_s`` fails, ``stream_end(message, sender)`` says whether a
        message ends its stream: ``"goodbye"`` (not delivered) or ``"last"`` (delivered, and
        nothing follows it), None otherwise (:class:`~.links.MessageStreams`)."""


class World(ABC):
    """Where a job's groups come from: who this process is, and the groups it belongs to."""

    @abstractmethod
    def job(self, rank: int | None, world_size: int | None
            ) -> tuple[int | None, int | None]:
        """This process's rank and the world size: the given ones, with what the world knows
        in place of a None (still None where it knows nothing: the caller reads the
        environment).

        Raises:
            ValueError: the given ones cannot be this world's, or it needs them given.
        """

    @abstractmethod
    def check(self, rank: int, world_size: int) -> None:
        """Raise RuntimeError unless this world can run rank ``rank`` of ``world_size`` now
        (before its first group)."""

    @abstractmethod
    def new_groups(self, rank_lists: Sequence[Sequence[int]], rank: int) -> list[Any]:
        """Create one group per list of global ranks, and return global rank ``rank``'s
        handle on each it belongs to (None for the others). Collective: every rank calls it
        with the same lists in the same order."""

    @abstractmethod
    def whole(self, rank: int) -> Any:
        """Global rank ``rank``'s handle on the group of every rank."""

    @abstractmethod
    def control_device(self) -> torch.device:
        """Where small control tensors (votes, agreement rows) must live for this world's
        groups to move them."""

    def links(self) -> str | None:
        """What the links between nodes run over, in words, for the layout log line (None:
        nothing to say)."""
        return None
