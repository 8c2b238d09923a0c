"""The nodes a job starts with begin their gossip together.

Without it a node that set up first gossiped alone: its messages to a neighbour still building
its model piled up to the links' bound (``max_backlog``), its step then waited for them to be
taken, and past the silence bound (``timeout_s``) it dropped that neighbour, and the neighbours
waiting on it dropped it in turn: nodes started a few tens of seconds apart (machines started
by hand, torch's import on a loaded machine) split the job before its first round.

:func:`start_together`: each rank of a starting node says at the rendezvous that it has set up
(its model, its optimizer, the job's agreement) and waits for the same rank of every other
starting node, up to the start bound (``join_timeout_s``), saying every few seconds what it
waits for. It stops waiting for a member the job refused (its options differ), and for one that
took its seat but whose beat (:mod:`.heartbeat`) stood still for the silence bound: it died
while it set up. Past the start bound it starts without the missing ones, as their links will.
Nodes that join a running job (a restart, a seat beyond the starting ones) do not wait: the
job's members let them in as they step.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from .heartbeat import PulseWatch, silence_of
from .refusals import refusal_of_member
from .seat import INCARNATION_KEY
from .waiting import REPORT_EVERY_S

__all__ = ["SET_UP_KEY", "start_together"]

log = logging.getLogger("qcomm")

SET_UP_KEY = "qcomm/linked/{rail}/set_up/{member}"


def start_together(store: dist.Store, member: int, starting: int, *, rail: str,
                   ranks: list[int], join_timeout_s: float, silence_s: float, where: str,
                   who: str, every_s: float = REPORT_EVERY_S, poll_s: float = 0.05
                   ) -> set[int]:
    """Say that ``member`` (of the job's first ``starting``) has set up on ``rail``, and wait
    until every other starting member has, or will not (module docstring).

    Args:
        store: a connection to the rendezvous (not prefixed).
        ranks: the members' global ranks on this rail, by member (for the messages).
        join_timeout_s: the longest wait (the start bound).
        silence_s: how long a seated member's beat may stand still before it is given up.
        where, who: the rendezvous's address and this rank, for the messages.

    Returns:
        the members not waited for to the end: refused, died while they set up, or not set
        up within ``join_timeout_s`` (empty when all came).
    """
    store.set(SET_UP_KEY.format(rail=rail, member=member), "1")
    waiting = {m for m in range(starting) if m != member}
    given_up: set[int] = set()
    watches: dict[tuple[int, int], PulseWatch] = {}
    start = time.monotonic()
    deadline, report = start + join_timeout_s, start + every_s
    while True:
        waiting = {m for m in waiting
                   if not store.check([SET_UP_KEY.format(rail=rail, member=m)])}
        if not waiting:
            return given_up
        now = time.monotonic()
        if now >= deadline:
            log.warning("qcomm: %s starts without members %s (ranks %s): not set up within "
                        "%g s", who, sorted(waiting), [ranks[m] for m in sorted(waiting)],
                        join_timeout_s)
            return given_up | waiting
        if now >= report:
            for m in sorted(waiting):
                why = _gone(store, m, ranks[m], silence_s, watches)
                if why is not None:
                    log.warning("qcomm: %s starts without member %d (rank %d): %s", who, m,
                                ranks[m], why)
                    waiting.discard(m)
                    given_up.add(m)
            if waiting:
                what = "; ".join(f"member {m} (rank {ranks[m]}) to start" for m in
                                 sorted(waiting))
                log.warning("qcomm: %s waits for %s at the rendezvous %s; %.0f s left of %g",
                            who, what, where, deadline - now, join_timeout_s)
            report = now + every_s
        time.sleep(min(poll_s, max(deadline - now, 0.0)))


def _gone(store: dist.Store, member: int, rank: int, silence_s: float,
          watches: dict[tuple[int, int], PulseWatch]) -> str | None:
    """Why ``member`` (global ``rank`` on this rail) will not set up (refused; seated and
    silent), else None (not seated yet, or beating: it is waited for)."""
    key = INCARNATION_KEY.format(member=member)
    if not store.check([key]):
        return None
    incarnation = int(store.add(key, 0))
    why = refusal_of_member(store, member, incarnation)
    if why is not None:
        return f"the job refused it ({why})"
    return silence_of(watches, member, store, rank, incarnation, silence_s)
