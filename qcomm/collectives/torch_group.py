"""``torch.distributed`` behind the group interface of :mod:`.group`: the one module that calls
its collectives and creates its groups.

* :class:`TorchGroup`: a process group (None: the default group) as a
  :class:`~.group.CommGroup`; its gossip messages go over Gloo point-to-point
  (:class:`~.gloo.transport.GlooTransport`, :class:`~.gloo.streams.GlooStreams`).
* :class:`TorchWorld`: the job torch.distributed runs (its rank and size, torchrun's
  ``RANK`` / ``WORLD_SIZE`` before it is initialized, ``new_group``).

:func:`resolve_group`, what every function taking a ``group`` calls first, wraps a
bare process group (or None) in a :class:`TorchGroup`.

The adapter is cheap to build (it asks torch.distributed for the members only when an error
needs to name them), so none is kept: a process group can be destroyed and the default group
re-initialized between two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from qcomm.collectives.gloo.link_groups import link_connect
from qcomm.collectives.gloo.streams import GlooStreams
from qcomm.collectives.gloo.transport import GlooTransport
from qcomm.collectives.group import REDUCE_OPS, CommGroup, Work, World
from qcomm.validation import check_choice, env_int, fail, fail_instance

if TYPE_CHECKING:
    from qcomm.collectives.links import MessageStreams, Transport
    from qcomm.collectives.stats import CommStats

__all__ = ["TorchGroup", "TorchWorld", "resolve_group"]

# torch 2.13 renames the flat collectives (same signatures) and warns on the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class TorchGroup(CommGroup):
    """A ``torch.distributed`` process group as a :class:`~.group.CommGroup`.

    Args:
        process_group: the group; None: the default group.
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group

    def _require(self) -> None:
        if not _initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "init_process_group first")

    @property
    def size(self) -> int:  # type: ignore[override]
        self._require()
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:  # type: ignore[override]
        self._require()
        return dist.get_rank(self.process_group)

    @property
    def ranks(self) -> list[int]:  # type: ignore[override]
        size = self.size
        if self.process_group is None:
            return list(range(size))
        return [dist.get_global_rank(self.process_group, i) for i in range(size)]

    # -----------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Work:
        check_choice("op", op, REDUCE_OPS)
        return dist.all_reduce(tensor, op=_DIST_OPS[op], group=self.process_group,
                               async_op=True)

    def all_reduce_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return _all_gather_flat(out, inp, group=self.process_group, async_op=True)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return dist.all_to_all_single(out, inp, group=self.process_group, async_op=True)

    def native_reduce_scatter(self, device: torch.device) -> bool:
        # NCCL has one; Gloo's would all-reduce the whole buffer.
        return device.type == "cuda" and "cuda:nccl" in dist.get_backend_config(
            self.process_group)

    def reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return _reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=self.process_group,
                                    async_op=True)

    def barrier(self) -> None:
        dist.barrier(self.process_group)

    # -----------------------------------------------------------------------------------------

    def transport(self, peers: list[int], *, stats: CommStats | None,
                  level: str) -> Transport:
        return GlooTransport(self.ranks, self.process_group, self.rank, peers, stats,
                             level=level)

    def streams(self, peers: list[int], *, nbytes: int, max_backlog: int, timeout_s: float,
                stream_end: Callable[[torch.Tensor, int], str | None], stats: CommStats | None,
                level: str) -> MessageStreams:
        # Each link a Gloo group of its own: on the shared one, a wait that times out on a
        # silent neighbour would close the links to the others too (gloo.link_groups).
        return GlooStreams(self.ranks, self.process_group, self.rank, peers, nbytes,
                           max_backlog=max_backlog, timeout_s=timeout_s,
                           stream_end=stream_end, stats=stats, level=level,
                           connect=link_connect(self.process_group, self.rank))

    def __repr__(self) -> str:
        return f"TorchGroup({self.process_group!r})"


# ---------------------------------------------------------------------------------------------
# the job


class TorchWorld(World):
    """The job ``torch.distributed`` runs. Its groups are process groups (the default group is
    None), so code that hands them to torch itself (DDP) gets what it expects.

    Before ``init_process_group`` the rank and size are torchrun's (``RANK``,
    ``WORLD_SIZE``)."""

    def job(self, rank: int | None, world_size: int | None
            ) -> tuple[int | None, int | None]:
        if _initialized():
            return (dist.get_rank() if rank is None else rank,
                    dist.get_world_size() if world_size is None else world_size)
        world_size = env_int("WORLD_SIZE", 1) if world_size is None else world_size
        return env_int("RANK", 0) if rank is None else rank, world_size

    def check(self, rank: int, world_size: int) -> None:
        if not _initialized():
            if world_size == 1:
                return
            raise RuntimeError(
                f"torch.distributed is not initialized, but this Topology has world_size="
                f"{world_size}: call init_process_group first"
            )
        ws, rk = dist.get_world_size(), dist.get_rank()
        if ws != world_size or rk != rank:
            raise RuntimeError(
                f"Topology was built for rank {rank} of world_size {world_size}, but "
                f"torch.distributed runs rank {rk} of world_size {ws}"
            )

    def new_groups(self, rank_lists: Sequence[Sequence[int]], rank: int
                   ) -> list[dist.ProcessGroup | None]:
        # Every rank calls new_group for every group, member or not (new_group is
        # collective). backend=None: the default group's backend configuration, so the
        # device and backend follow the tensors.
        out: list[Any] = []
        for ranks in rank_lists:
            group = dist.new_group(list(ranks))
            out.append(group if rank in ranks else None)
        return out

    def whole(self, rank: int) -> None:
        return None

    def control_device(self) -> torch.device:
        if "cpu:" in dist.get_backend_config():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def links(self) -> str | None:
        if not _initialized():
            return None
        return (f"torch.distributed's process groups ({dist.get_backend_config()}), every "
                "port open between the nodes")

    def __repr__(self) -> str:
        return "TorchWorld()"


def resolve_group(group: Any) -> CommGroup:
    """``group`` as a :class:`CommGroup`: itself when it is one, else the
    ``torch.distributed`` process group it names (None: the default group) as a
    :class:`TorchGroup`."""
    if isinstance(group, CommGroup):
        return group
    if isinstance(group, type):  # never a handle; the wrapper would take it and fail much later
        fail_instance("group", group, CommGroup, "a qcomm.collectives.group.CommGroup")
        fail("group", "a CommGroup, a torch.distributed process group or None", group, TypeError)
    return TorchGroup(group)
