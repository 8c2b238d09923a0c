"""Completion handles of collectives that run in stages.

An operation is a list of *pipelines*, one per bucket. A pipeline is a generator: it does local
work, launches a non-blocking collective and yields its ``Work`` (or a list of them, or None);
the driver waits for what was yielded and resumes the generator, which does the next local work
(decode, accumulate) and launches the next collective, and so on; its last segment writes the
results into the caller's tensors.

Why generators driven from ``wait()`` and not a background thread: collectives on one process
group must be issued in the same order on every rank. A progress thread would interleave our
launches with other users of the same groups (the gossip shares the rails) in an order
that depends on timing. Here every launch happens in the caller's thread, inside ``mean_`` (the
first stage of every bucket) or ``wait()`` (later stages, buckets round-robin in a fixed order),
so the order is the program's order, the same on every rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterable
from typing import Any

from qcomm.collectives.primitives import wait_work

__all__ = ["Handle", "Last", "Pipeline"]

# A pipeline yields what to wait for next: a Work, a list of them, None, or Last(...) around its
# final communication stage (what follows is local work only).
Pipeline = Generator[Any, None, None]


class Last:
    """What a pipeline yields at its last communication stage (lets is_completed() be exact)."""

    def __init__(self, item: Any) -> None:
        self.item = item


def _works(item: Any) -> tuple[list[Any], bool]:
    """(works to wait for, whether no communication follows them)."""
    last = isinstance(item, Last)
    if last:
        item = item.item
    if item is None:
        return [], last
    if isinstance(item, (list, tuple)):
        return [w for w in item if w is not None], last
    return [item], last


class Handle:
    """Completion handle of a (possibly multi-stage) collective.

    ``wait()`` completes the operation, including decoding and accumulating received payloads,
    and only then writes the results into the caller's tensors. The caller must not modify, nor
    read as results, those tensors between the call that returned the handle and ``wait()``.

    ``is_completed()`` is True when ``wait()`` would not wait on any peer. Later stages of a
    multi-stage operation (hierarchical allreduce) are launched only by ``wait()`` (see the
    module docstring), so for those ``is_completed()`` stays False until ``wait()`` is called:
    a poll-only loop must eventually call ``wait()``. Single-stage operations (intra-node
    allreduce) become completed on their own.
    """

    def __init__(self, pipelines: Iterable[Pipeline], operation: str,
                 peers: list[int] | None = None, link: str | None = None) -> None:
        self._operation = operation
        self._peers = list(peers or [])
        self._link = link
        self._error: BaseException | None = None
        # Start every pipeline: runs its first local step and launches its first collective.
        self._active: list[tuple[Pipeline, list[Any], bool]] = []
        for p in pipelines:
            with contextlib.suppress(StopIteration):
                self._active.append((p, *_works(next(p))))

    @classmethod
    def completed(cls, operation: str = "no-op") -> Handle:
        """A handle with nothing left to do."""
        return cls((), operation)

    def is_completed(self) -> bool:
        """True when ``wait()`` would not wait on any peer: every pipeline is at its last
        communication stage and that stage's collectives finished (or everything is done)."""
        if self._error is not None:
            return True
        return all(last and all(w.is_completed() for w in works)
                   for _, works, last in self._active)

    def wait(self, timeout_s: float | None = None) -> None:
        """Complete the operation and write the results into the caller's tensors.

        Args:
            timeout_s: seconds to wait for peers in total; None waits as long as the process
                group's own timeout allows.

        Raises:
            PeerTimeoutError: a peer did not answer in time; PeerLostError: the connection to
                a peer broke. The process group is then in an unknown state (collectives may
                still be in flight); treat it as fatal.
            Whatever a stage raised (e.g. NonFiniteError), again on later calls.
        """
        if self._error is not None:
            raise self._error
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        failed: BaseException | None = None
        try:
            while self._active:
                still: list[tuple[Pipeline, list[Any], bool]] = []
                # Round-robin over buckets in a fixed order: wait for bucket b's stage k, launch
                # its stage k + 1, then move on to bucket b + 1 (overlaps b's next stage with
                # b + 1's wait, deterministically).
                for pipeline, works, _ in self._active:
                    for w in works:
                        self._wait_one(w, deadline, timeout_s)
                    try:
                        still.append((pipeline, *_works(next(pipeline))))
                    except StopIteration:
                        pass
                    except Exception as e:
                        # A pipeline raises only after its last collective (e.g. NonFiniteError
                        # once every peer has its payload): the other buckets still finish, so
                        # this rank issues the same collectives as its peers.
                        failed = failed or e
                self._active = still
        except BaseException as e:
            # Waiting itself failed (timeout, dead peer): stop everything.
            self._error = e
            for pipeline, _, _ in self._active:
                pipeline.close()
            self._active = []
            raise
        if failed is not None:
            self._error = failed
            raise failed

    def _wait_one(self, work: Any, deadline: float | None, timeout_s: float | None) -> None:
        wait_work(work, deadline, timeout_s, self._operation, self._peers, self._link)
