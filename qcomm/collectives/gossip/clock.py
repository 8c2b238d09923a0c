"""The step clock: how many local steps a run has ended, one object whoever reads it.

The engine holds one :class:`StepClock` for the whole run and hands it to the gossip member it
builds: the member advances it at each :meth:`~.member.GossipMember.end_step` and says from it
when a round is due, the engine reads the same count (and advances it itself while there is no
gossip: one node, a single process). A member built without one makes its own.
"""

from __future__ import annotations

from qcomm.validation import check_int

__all__ = ["StepClock"]


class StepClock:
    """Local steps ended, from ``steps`` (an int >= 0)."""

    __slots__ = ("steps",)

    def __init__(self, steps: int = 0) -> None:
        self.steps = check_int("first_step", steps, low=0)

    def tick(self) -> None:
        """One more step ended."""
        self.steps += 1

    def restart(self, steps: int) -> None:
        """Count on from ``steps`` (an int >= 0: a run resumed)."""
        self.steps = check_int("steps", steps, low=0)

    def __repr__(self) -> str:
        return f"StepClock(steps={self.steps})"
