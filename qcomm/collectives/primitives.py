"""The steps every collective of this package is built from.

Everything here goes through the :class:`~qcomm.collectives.group.CommGroup` interface, so the
same code runs over torch.distributed (:mod:`.torch_group`) and in memory (:mod:`.memory`). A
caller holding a handle (a ``torch.distributed`` process group, or None: the default group)
makes it a ``CommGroup`` once, with :func:`resolve_group` (a
:class:`~qcomm.collectives.topology.Topology` holds its groups resolved: ``intra``, ``rail``,
``whole``), and passes that on: every function here takes a resolved group, and refuses a bare
handle by name rather than resolving it again on every call.

* wrappers: :func:`all_reduce`, :func:`all_gather_flat`, :func:`all_to_all_single`, and
  :func:`all_reduce_mean_future` (DDP's own averaging, for the hook's warm-up), each posting
  on the group and waiting with a deadline; a backend's failure becomes a
  :class:`~qcomm.collectives.errors.PeerError` naming the peers and the link;
* pipeline steps used by the bucketed means (:mod:`.intra`, :mod:`.hierarchical`):
  :func:`start_reduce_scatter`, :func:`start_all_gather`, :func:`quantize_or_poison`,
  :func:`decode_mean`, with :func:`acc_dtype` (message seeds: :func:`qcomm.seeds.derive`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from qcomm.collectives.errors import (
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    backend_detail,
)
from qcomm.collectives.group import CommGroup, Work
from qcomm.collectives.stats import CommStats
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import ErrorFeedback, NonFiniteError, QuantSpec, dequant_accumulate

__all__ = [
    "Posted",
    "acc_dtype",
    "all_gather_flat",
    "all_reduce",
    "all_reduce_mean_future",
    "all_to_all_single",
    "as_peer_error",
    "decode_mean",
    "quantize_or_poison",
    "resolve_group",
    "start_all_gather",
    "start_reduce_scatter",
    "wait_work",
    "wait_works",
]


# ---------------------------------------------------------------------------------------------
# waiting with a deadline, and naming who failed


def _resolved(group: object) -> CommGroup:
    """``group`` when it is a :class:`CommGroup`; else TypeError naming the argument (a bare
    handle is resolved once by its owner, not again by every call)."""
    if isinstance(group, CommGroup):
        return group
    if isinstance(group, type):
        resolve_group(group)  # names the class: "did you mean ...(...)?"
    raise TypeError(f"group must be a qcomm.collectives.group.CommGroup (resolve a "
                    f"torch.distributed process group once with resolve_group(group), or use "
                    f"Topology.intra / .rail / .whole), got {type(group).__name__}: {group!r}")


def as_peer_error(e: RuntimeError, operation: str, timeout_s: float | None,
                  peers: list[int], link: str | None) -> PeerError:
    """A backend's RuntimeError (Gloo: connection closed or reset, its own timeout) as the
    qcomm error that says what happened, to whom, on which link."""
    if isinstance(e, PeerError):
        return e
    text = backend_detail(e)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return PeerTimeoutError(f"{operation} [{text}]", timeout_s or 0.0, peers, link)
    return PeerLostError(operation, peers, link, detail=text)


class Posted:
    """A collective in flight and what an error about it must name: the step (e.g.
    ``"inter-node all-gather"``), the group it runs on and the link. The stages of a
    multi-stage mean run on different groups, so the handle waiting on them cannot know this
    itself; :func:`wait_work` reads it from here."""

    __slots__ = ("group", "link", "operation", "work")

    def __init__(self, work: Work, operation: str, group: CommGroup, link: str | None) -> None:
        self.work, self.operation, self.group, self.link = work, operation, group, link

    @property
    def peers(self) -> list[int]:
        """The group's other members; asked only when an error names them (a process group
        answers with one call per member, which a healthy step need not pay)."""
        return self.group.other_ranks()

    def wait(self) -> Any:
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def wait_work(work: Any, deadline: float | None, timeout_s: float | None, operation: str,
              peers: list[int], link: str | None) -> None:
    """Wait for one backend work until ``deadline`` (``time.monotonic()``; None: no deadline).
    A :class:`Posted` work names its own step, peers and link in the error (``operation``
    then says what it was part of).

    Raises:
        PeerTimeoutError: past the deadline. PeerLostError: the backend failed the work.
    """
    posted = work if isinstance(work, Posted) else None
    if posted is not None:
        operation = f"{operation} ({posted.operation})" if operation else posted.operation
        link, work = posted.link, posted.work
    try:
        if deadline is None:
            work.wait()
            return
        # Work.wait(timeout) semantics differ between backends and ops; poll instead, with a
        # short sleep that grows to 1 ms so a slow peer does not cost a busy core.
        pause = 5e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise PeerTimeoutError(operation, float(timeout_s),
                                       posted.peers if posted is not None else peers, link)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()  # re-raises a failure of the collective itself
    except RuntimeError as e:
        raise as_peer_error(e, operation, timeout_s, posted.peers if posted is not None else peers,
                            link) from e


def wait_works(works: list[Any], timeout_s: float | None, operation: str, group: CommGroup,
               link: str | None) -> None:
    """Wait for ``works`` on ``group`` (resolved) with one deadline for all of them."""
    group = _resolved(group)
    deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
    peers = group.other_ranks()
    for w in works:
        wait_work(w, deadline, timeout_s, operation, peers, link)


def _post(fn: Any, operation: str, group: CommGroup, link: str | None) -> Any:
    """Call ``fn()`` (which posts a non-blocking collective); a backend error while posting
    (a connection already broken) becomes a :class:`PeerLostError`."""
    try:
        return fn()
    except PeerError:
        raise  # already names what failed (a synchronous group's timeout)
    except RuntimeError as e:
        raise as_peer_error(e, operation, None, group.other_ranks(), link) from e


def _finish(work: Work, async_op: bool, operation: str, group: CommGroup,
            link: str | None) -> Posted | None:
    """``work`` (labelled) when the caller waits for it itself, else None once it completed."""
    if async_op:
        return Posted(work, operation, group, link)
    work.wait()
    return None


# ---------------------------------------------------------------------------------------------
# wrappers: one call for every kind of group


def all_reduce(tensor: torch.Tensor, group: CommGroup, op: str = "sum", *,
               timeout_s: float | None = None, link: str | None = None,
               operation: str = "all_reduce") -> None:
    """Reduce ``tensor`` in place over ``group`` (resolved; ``op``:
    ``"sum"``, ``"max"`` or ``"min"``), blocking, for at most ``timeout_s`` seconds (None: the
    group's own timeout).

    Raises:
        PeerTimeoutError, PeerLostError: naming the group's other ranks and ``link``.
    """
    g = _resolved(group)
    work = _post(lambda: g.all_reduce(tensor, op), operation, g, link)
    wait_works([work], timeout_s, operation, g, link)


def all_reduce_mean_future(tensor: torch.Tensor, group: CommGroup) -> torch.futures.Future:
    """DDP's own averaging: ``tensor`` divided by the group's size, then summed over ``group``
    (resolved) asynchronously. Returns a future completing with the averaged ``tensor``."""
    tensor.div_(group.size)
    return group.all_reduce_future(tensor)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: CommGroup, *,
                    async_op: bool = False, link: str | None = None,
                    operation: str = "all_gather") -> Work | None:
    """``out`` (flat, ``size * inp.numel()``) = every member's ``inp`` by group rank, over
    ``group`` (resolved). Returns the work when ``async_op``."""
    group = _resolved(group)
    return _post(lambda: _finish(group.all_gather_flat(out, inp), async_op, operation, group,
                                 link), operation, group, link)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: CommGroup, *,
                      async_op: bool = False, link: str | None = None,
                      operation: str = "all_to_all") -> Work | None:
    """Equal-split all-to-all over ``group`` (resolved): chunk k of ``out`` = chunk ``my rank``
    of member k's ``inp``. Returns the work when ``async_op``."""
    return _post(lambda: _finish(group.all_to_all_single(out, inp), async_op, operation, group,
                                 link), operation, group, link)


# ---------------------------------------------------------------------------------------------
# pipeline steps


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype sums are accumulated in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def start_reduce_scatter(buf: torch.Tensor, group: CommGroup, size: int, stats: CommStats,
                         level: str) -> tuple[Any, Any]:
    """Start summing ``buf`` (flat ``[size * c]``, wire dtype) over ``group`` (resolved): rank
    i gets the sum of everyone's chunk i. Returns (work, result) where ``result()``, called
    after the work completed, gives that sum as a new ``[c]`` tensor in :func:`acc_dtype`."""
    c = buf.numel() // size
    stats.record(level, (size - 1) * c * buf.element_size(), size - 1)
    acc = acc_dtype(buf.dtype)
    if group.native_reduce_scatter(buf.device):
        out = torch.empty(c, dtype=buf.dtype, device=buf.device)
        operation = f"{level}-node reduce-scatter"
        work = _post(lambda: Posted(group.reduce_scatter_flat(out, buf), operation, group,
                                    level), operation, group, level)
        return work, lambda: out.to(acc)
    # Otherwise (Gloo: its reduce-scatter would all-reduce the whole buffer) all-to-all moves
    # (size-1)/size of it, and the received chunks are summed here, by source rank, in acc
    # dtype.
    recv = torch.empty_like(buf)
    work = all_to_all_single(recv, buf, group, async_op=True, link=level,
                             operation=f"{level}-node reduce-scatter")
    return work, lambda: recv.view(size, c).sum(dim=0, dtype=acc)


def start_all_gather(out: torch.Tensor, shard: torch.Tensor, group: CommGroup, size: int,
                     stats: CommStats, level: str) -> Any:
    """Start ``out = cat(every member's shard)`` (flat, by group rank) over ``group``
    (resolved). Returns the work."""
    stats.record(level, (size - 1) * shard.numel() * shard.element_size(), size - 1)
    return all_gather_flat(out, shard, group, async_op=True, link=level,
                           operation=f"{level}-node all-gather")


def quantize_or_poison(ef: ErrorFeedback, key: str, x: torch.Tensor, spec: QuantSpec, seed: int,
                       out: torch.Tensor) -> None:
    """Quantize ``x`` with error feedback into ``out`` without a host read (no sync before the
    collective that sends it). A non-finite input leaves NaN scales in ``out``, which is sent
    anyway: every peer's decode, this rank's included (:func:`decode_mean`), then raises, and
    all ranks finish the same collectives (no rank is left hanging). The new residual waits
    for ``ef.commit(key)``, which the caller makes once the whole mean succeeded; it reads the
    deferred check too (:meth:`ErrorFeedback.quantize` with ``non_blocking``), so a poisoned
    residual can never become the current one."""
    ef.quantize(key, x, spec, seed=seed, out=out, commit=False, non_blocking=True)


def decode_mean(payloads: torch.Tensor, out: torch.Tensor,
                spec: QuantSpec) -> NonFiniteError | None:
    """``out += mean_k D(payloads[k])``; on a non-finite payload fill ``out`` with NaN and return
    the error (raised by the handle once every collective finished)."""
    k = payloads.shape[0]
    try:
        dequant_accumulate(payloads, out, spec, weights=[1.0 / k] * k)
    except NonFiniteError as e:
        out.fill_(float("nan"))
        return e
    return None

