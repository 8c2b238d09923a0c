"""A node's pulse at the rendezvous: what tells a peer that is still starting from one that died.

A link's other end may take long to open it: its process imports torch, builds its model and
loads its data first, which on a loaded machine takes tens of seconds. Bounding that wait by
the link's silence bound (``timeout_s``, seconds to tens of seconds for a job that must notice a
lost node quickly) dropped peers that were only slow to start, and the job split. Bounding it by
a long start bound alone would keep the others waiting for a peer that died before it opened its
link (a joiner killed during its join).

So every process of a linked node beats: a thread adds 1 to its key at the rendezvous every
:data:`BEAT_EVERY_S` seconds, from the moment it holds its seat. A peer waiting for it to open a
link waits up to the start bound (``join_timeout_s``) as long as the count moves, and gives up
once it stood still for the silence bound (:class:`PulseWatch`). The count is per process and
incarnation, so a restarted node's beat does not vouch for the process it replaced.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time

import torch.distributed as dist

__all__ = ["BEAT_EVERY_S", "PULSE_KEY", "Heartbeat", "PulseWatch", "silence_of",
           "start_heartbeat"]

log = logging.getLogger(__name__)

BEAT_EVERY_S = 1.0
PULSE_KEY = "qcomm/pulse/{rank}/{incarnation}"


class Heartbeat:
    """This process's beat at the rendezvous (made by :func:`start_heartbeat`): a daemon
    thread that adds 1 to ``PULSE_KEY`` (global ``rank``, ``incarnation``) in ``store`` every
    :data:`BEAT_EVERY_S` seconds until :meth:`stop`, or until the rendezvous (``where``, for
    the log) stops answering; ``timeout_s`` is the store's own timeout."""

    def __init__(self, store: dist.Store, rank: int, incarnation: int, where: str,
                 timeout_s: float) -> None:
        self.store, self.where, self.timeout_s = store, where, timeout_s
        self.key = PULSE_KEY.format(rank=rank, incarnation=incarnation)
        self._stop = threading.Event()
        store.add(self.key, 1)   # the first beat before the thread: a peer sees it at once
        self.thread = threading.Thread(target=self._beat, daemon=True,
                                       name=f"qcomm-pulse-{rank}")
        self.thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            try:
                self.store.add(self.key, 1)
            except Exception as e:   # the rendezvous ended (or its connection): so does the beat
                log.info("qcomm: %s stops beating at the rendezvous %s (%s)", self.key,
                         self.where, e)
                return

    def stop(self) -> None:
        """End the beat and wait until its thread has left, up to the store's timeout: an add
        in flight returns within it. Run at exit, before the interpreter finalizes: a daemon
        thread that comes back from a C++ call (the store's add) once finalization started is
        ended inside it, and the process aborts ("terminate called without an active
        exception") after a run that had finished. The wait used to be 5 beats, and an add can
        take longer: the rendezvous's store serves on one thread, which a name lookup holds for
        the resolver's timeout (5 s) where the DNS server drops a query."""
        self._stop.set()
        self.thread.join(timeout=self.timeout_s + BEAT_EVERY_S)


def start_heartbeat(host: str, port: int, rank: int, incarnation: int,
                    timeout_s: float) -> Heartbeat:
    """Start this process's beat at the rendezvous ``host:port``: a daemon thread that adds 1
    to ``PULSE_KEY`` (global ``rank``, the node's ``incarnation``) every :data:`BEAT_EVERY_S`
    seconds over a connection of its own (``timeout_s``: its timeout), until the process ends
    (stopped at exit) or the rendezvous stops answering (it may end once the job runs: nothing
    else needs it then)."""
    from .tunnel import store_client

    store = store_client(host, port, datetime.timedelta(seconds=timeout_s))
    beat = Heartbeat(store, rank, incarnation, f"{host}:{port}", timeout_s)
    atexit.register(beat.stop)
    return beat


class PulseWatch:
    """Whether a peer (global ``rank``, ``incarnation``) still beats, as seen from a wait for
    it: :meth:`check` raises once its count stood still for ``silence_s`` seconds (a peer
    that never beat counts from the watch's making), its message ending with ``lost_as``
    (what the silence means to the wait)."""

    def __init__(self, store: dist.Store, rank: int, incarnation: int,
                 silence_s: float, lost_as: str = "lost before it opened its link") -> None:
        self.store, self.lost_as = store, lost_as
        self.key = PULSE_KEY.format(rank=rank, incarnation=incarnation)
        self.rank, self.incarnation = rank, incarnation
        self.silence_s = silence_s
        self.count = self._read()
        self.moved = time.monotonic()

    def _read(self) -> int:
        return int(self.store.add(self.key, 0))

    def check(self) -> None:
        """Raises RuntimeError when the peer's beat stood still for ``silence_s``."""
        count, now = self._read(), time.monotonic()
        if count != self.count:
            self.count, self.moved = count, now
        elif now - self.moved >= self.silence_s:
            state = "never beat" if count == 0 else f"stopped beating {now - self.moved:.0f} s ago"
            raise RuntimeError(
                f"rank {self.rank} (incarnation {self.incarnation}) {state} at the rendezvous "
                f"(no sign of life within {self.silence_s:g} s): {self.lost_as}")


def silence_of(watches: dict[tuple[int, int], PulseWatch], member: int, store: dist.Store,
               rank: int, incarnation: int, silence_s: float,
               lost_as: str = "lost before it opened its link") -> str | None:
    """Why ``member`` (global ``rank`` at ``incarnation``) counts as gone by its beat, or None
    while it beats: its :class:`PulseWatch` in ``watches`` (made at the first ask, kept across
    the asks of one wait), checked."""
    watch = watches.get((member, incarnation))
    if watch is None:
        watch = watches[(member, incarnation)] = PulseWatch(store, rank, incarnation,
                                                            silence_s, lost_as)
    try:
        watch.check()
    except RuntimeError as e:
        return str(e)
    return None
