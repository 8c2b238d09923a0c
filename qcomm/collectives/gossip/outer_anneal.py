"""The outer step's learning rate over a run of known length: full early, where the outer
Nesterov step makes the nodes sprint, annealed late to where it no longer amplifies the inner
steps' progress, so that a run ends at its best instead of declining.

An outer Nesterov step with momentum ``mu`` and learning rate ``lr`` moves a fragment by
``lr / (1 - mu)`` times its progress in a steady state (0.5 / (1 - 0.9) = 5 for the slow-link
setting): a fivefold learning rate that reaches a mark early and, at a constant inner learning
rate, overfits and declines late. With ``total_steps`` the outer lr stays at ``lr`` for the
first :data:`HOLD` of the run, then follows a cosine to ``min(lr, 1 - mu)`` (amplification 1:
the progress as the inner optimizer made it) at ``total_steps``, and stays there after it.
The step it is given is the job's progress as the member knows it
(:meth:`~.member.GossipMember.progress`): a node slower than the others anneals with them.
"""

from __future__ import annotations

import math

__all__ = ["HOLD", "annealed_outer_lr"]

# The fraction of the run the outer lr is held at its value before it anneals.
HOLD = 0.3


def annealed_outer_lr(outer_lr: float, outer_momentum: float, step: int,
                      total_steps: int | None) -> float:
    """The outer learning rate after ``step`` local steps of a run of ``total_steps``.

    Args:
        outer_lr (float): the outer step's learning rate, held for the first 30% of the run.
        outer_momentum (float): its Nesterov momentum ``mu``.
        step (int): local steps taken so far (>= 0).
        total_steps (int | None): the run's length; None: ``outer_lr`` at every step.

    Returns:
        float: ``outer_lr`` early; then a cosine to ``min(outer_lr, 1 - mu)`` at the end.
    """
    if total_steps is None:
        return outer_lr
    end = min(outer_lr, 1.0 - outer_momentum)
    start = HOLD * total_steps
    if step <= start:
        return outer_lr
    done = min(1.0, (step - start) / (total_steps - start))
    return end + (outer_lr - end) * 0.5 * (1.0 + math.cos(math.pi * done))
