"""Which saved engine entries load into which run (qcomm.engine.state.check_loadable), for the
states of runs that lost nodes: the survivors restarted alone load exactly, a run of the same
size needs ``reinit``, anything else is refused with both geometries named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qcomm.engine.options import CommOptions
from qcomm.engine.state import EngineStateFile, check_loadable

OPTIONS = CommOptions(wait_free=True, on_peer_loss="continue")


def _saved(world: int, ppn: int, rank: int, lost: list[int]) -> dict:
    return EngineStateFile.build((world, ppn, rank), steps=10, skipped_steps=0,
                                 options=OPTIONS, gossip={"lost": lost}, intra=None,
                                 comm_stats={})


def _run(world: int, ppn: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, procs_per_node=ppn, rank=rank)


@pytest.mark.parametrize(("saved_rank", "world", "ppn", "rank", "lost"), [
    (2, 3, 1, 1, [1]),      # 4x1 lost node 1: saved rank 2 is the second survivor
    (3, 3, 1, 2, [1]),
    (0, 3, 1, 0, [1]),
    (5, 4, 2, 3, [1]),      # 3x2 lost node 1: saved rank 5 (node 2, local 1) -> rank 3
    (4, 2, 1, 1, [1, 2, 3]),
])
def test_the_survivors_restarted_alone_load_exactly(saved_rank: int, world: int, ppn: int,
                                                    rank: int, lost: list[int]) -> None:
    saved_world = world + len(lost) * ppn
    state = _saved(saved_world, ppn, saved_rank, lost)
    assert check_loadable(state, OPTIONS, _run(world, ppn, rank)) is True


@pytest.mark.parametrize(("saved_rank", "world", "rank", "match"), [
    (2, 3, 0, "world size 4"),      # not this rank's place among the survivors
    (2, 2, 1, "world size 4"),      # not the survivors (one node fewer)
    (2, 4, 2, "reinit"),            # the same size: the lost node came back
])
def test_other_runs_are_refused_by_default(saved_rank: int, world: int, rank: int,
                                           match: str) -> None:
    state = _saved(4, 1, saved_rank, [1])
    with pytest.raises(ValueError, match=match):
        check_loadable(state, OPTIONS, _run(world, 1, rank))


def test_with_reinit_any_rank_may_load_a_survivors_entry() -> None:
    state = _saved(4, 1, 0, [1])
    with pytest.warns(UserWarning, match="lost"):
        assert check_loadable(state, OPTIONS, _run(4, 1, 1),
                              on_world_size_change="reinit") is False
