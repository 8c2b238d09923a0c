"""The losses a rank reports at the end (:func:`qcomm.engine.report.lost_and_back`): a node that
was dropped and came back into the running job is reported back, not dropped; one lost again
after its return is lost."""

from __future__ import annotations

import pytest

from qcomm.engine.report import lost_and_back


@pytest.mark.parametrize(("dropped", "rejoined", "still", "back"), [
    ([], [], [], []),
    ([1], [], [1], []),
    ([1], [1], [], [1]),                 # lost, then restarted into the job
    ([1, 1], [1], [1], []),              # lost, back, lost again
    ([1, 1], [1, 1], [], [1]),
    ([3, 0, 1], [1], [0, 3], [1]),
])
def test_a_rank_is_back_when_it_returned_after_each_loss(
        dropped: list[int], rejoined: list[int], still: list[int], back: list[int]) -> None:
    assert lost_and_back(dropped, rejoined) == (still, back)
