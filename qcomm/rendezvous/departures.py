"""Members that left the running job, and whether any member is still there to hand a joiner
its state.

A node that comes back waits at the rendezvous for a running member to hand it the state to
start from (:func:`~qcomm.rendezvous.joins.await_state`). When no member runs any more (the job
ended while the node restarted, or every other node is lost) nobody will: the joiner waited
out its whole bound (``timeout_s``, 300 s by default) before it failed. So a member that stops
gossiping says so (:func:`leave`, under its seat and incarnation, in the joins' rail; taken
back by :func:`returns` when the same process builds a new optimizer), and a joiner's wait
checks the other members (:class:`RunningMembers`): it stops as soon as each of them left, was
refused, never took its seat, or stood silent (its beat, :mod:`.heartbeat`) for the silence
bound, naming each one and why.
"""

from __future__ import annotations

import torch.distributed as dist

from .heartbeat import PulseWatch, silence_of
from .refusals import refusal_of_member
from .seat import INCARNATION_KEY

__all__ = ["LEFT_KEY", "NoRunningMemberError", "RunningMembers", "has_left", "leave",
           "returns"]

LEFT_KEY = "qcomm/left/{member}/{incarnation}"


class NoRunningMemberError(RuntimeError):
    """No other member of the job can hand this joiner its state: each left, was refused,
    never took its seat or went silent (the message names them). The job has ended, or every
    other node is lost: start the job anew."""


def leave(store: dist.Store, member: int, incarnation: int) -> None:
    """Record in ``store`` (the joins' rail) that ``member`` at ``incarnation`` stopped
    gossiping: it hands no joiner a state any more."""
    store.set(LEFT_KEY.format(member=member, incarnation=incarnation), "1")


def returns(store: dist.Store, member: int, incarnation: int) -> None:
    """Take back ``member``'s :func:`leave` at ``incarnation`` in ``store``: the same process
    gossips again (an optimizer closed, then built anew on the same seat)."""
    store.delete_key(LEFT_KEY.format(member=member, incarnation=incarnation))


def has_left(store: dist.Store, member: int, incarnation: int) -> bool:
    """Whether ``member`` at ``incarnation`` said it left (:func:`leave`) in ``store``."""
    return store.check([LEFT_KEY.format(member=member, incarnation=incarnation)])


class RunningMembers:
    """The members that might still hand a joiner its state, as its wait checks them.

    Args:
        client: a connection to the rendezvous (not prefixed: seats, beats and refusals).
        rail: the same, prefixed as the joins of this joiner's rail are (where members leave).
        ranks: each other member's global rank on this rail, by member (this joiner left out).
        silence_s: how long a seated member's beat may stand still before it counts as gone.
    """

    def __init__(self, client: dist.Store, rail: dist.Store, ranks: dict[int, int],
                 silence_s: float) -> None:
        self.client, self.rail, self.ranks, self.silence_s = client, rail, ranks, silence_s
        self._watches: dict[tuple[int, int], PulseWatch] = {}

    def gone(self, member: int) -> str | None:
        """Why ``member`` will hand no joiner a state, or None (it may: seated and beating)."""
        key = INCARNATION_KEY.format(member=member)
        if not self.client.check([key]):
            return f"member {member} never took its seat"
        incarnation = int(self.client.add(key, 0))
        named = f"member {member} (incarnation {incarnation})"
        if has_left(self.rail, member, incarnation):
            return f"{named} left the job"
        why = refusal_of_member(self.client, member, incarnation)
        if why is not None:
            return f"{named} was refused ({why})"
        silent = silence_of(self._watches, member, self.client, self.ranks[member],
                            incarnation, self.silence_s, lost_as="lost")
        return None if silent is None else f"member {member}: {silent}"

    def check(self) -> None:
        """Return while some member may still hand the state; else raise.

        Raises:
            NoRunningMemberError: every other member is gone (each named, with why).
        """
        reasons = []
        for member in sorted(self.ranks):
            why = self.gone(member)
            if why is None:
                return
            reasons.append(why)
        raise NoRunningMemberError(
            "no member of the job is left to hand this joiner its state: "
            + "; ".join(reasons) + ". The job has ended, or every other node is lost")
