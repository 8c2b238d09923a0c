"""Members that left the running job (:mod:`qcomm.rendezvous.departures`): a joiner's wait goes
on while one other member may still hand it its state, and stops, naming every member and why,
once none can; a node's rank says it left when it closes. Stores in this process (a HashStore,
or a rendezvous in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from qcomm.engine.joins import NodeJoins
from qcomm.rendezvous import LinkedSeat
from qcomm.rendezvous.departures import (
    NoRunningMemberError,
    RunningMembers,
    has_left,
    leave,
)
from qcomm.rendezvous.heartbeat import PULSE_KEY
from qcomm.rendezvous.joins import announce, await_state, offer_state
from qcomm.rendezvous.refusals import record_refusal
from qcomm.rendezvous.seat import claim_incarnation
from tests.rendezvous_thread import rendezvous_in_thread


def _stores() -> tuple[dist.Store, dist.Store]:
    client = dist.HashStore()
    return client, dist.PrefixStore("qcomm/linked/rail0/", client)


def _beat(client: dist.Store, rank: int, incarnation: int) -> None:
    client.add(PULSE_KEY.format(rank=rank, incarnation=incarnation), 1)


def test_a_seated_member_that_beats_may_still_hand_the_state() -> None:
    client, rail = _stores()
    claim_incarnation(client, 0)
    _beat(client, 0, 1)
    leave(rail, 2, 1)                       # member 2 left; member 0 still runs
    claim_incarnation(client, 2)
    running = RunningMembers(client, rail, {0: 0, 2: 2}, silence_s=60)
    running.check()
    assert running.gone(0) is None
    assert running.gone(2) == "member 2 (incarnation 1) left the job"


def test_once_every_other_member_is_gone_the_check_names_each_and_why() -> None:
    client, rail = _stores()
    for member in (0, 2):
        claim_incarnation(client, member)
    leave(rail, 0, 1)
    record_refusal(client, 2, 1, "its bits differ")
    running = RunningMembers(client, rail, {0: 0, 2: 2, 3: 3}, silence_s=60)
    with pytest.raises(NoRunningMemberError) as e:
        running.check()
    msg = str(e.value)
    assert "member 0 (incarnation 1) left the job" in msg
    assert "member 2 (incarnation 1) was refused (its bits differ)" in msg
    assert "member 3 never took its seat" in msg
    assert msg.endswith("The job has ended, or every other node is lost")


def test_a_member_that_came_back_is_not_taken_for_its_earlier_incarnation_that_left() -> None:
    client, rail = _stores()
    claim_incarnation(client, 0)
    leave(rail, 0, 1)
    claim_incarnation(client, 0)            # restarted by its torchrun: incarnation 2
    assert not has_left(rail, 0, 2)
    RunningMembers(client, rail, {0: 0}, silence_s=60).check()


def test_leaving_one_rail_leaves_the_others_running() -> None:
    client, rail0 = _stores()
    rail1 = dist.PrefixStore("qcomm/linked/rail1/", client)
    claim_incarnation(client, 0)
    leave(rail0, 0, 1)
    assert has_left(rail0, 0, 1) and not has_left(rail1, 0, 1)
    RunningMembers(client, rail1, {0: 1}, silence_s=60).check()
    with pytest.raises(NoRunningMemberError):
        RunningMembers(client, rail0, {0: 0}, silence_s=60).check()


def test_a_member_silent_for_the_silence_bound_is_gone() -> None:
    client, rail = _stores()
    claim_incarnation(client, 4)
    _beat(client, 9, 1)                     # member 4's rank on this rail is 9
    running = RunningMembers(client, rail, {4: 9}, silence_s=0.3)
    running.check()                         # it beat: waited for
    time.sleep(0.4)
    with pytest.raises(NoRunningMemberError, match=r"member 4: rank 9 \(incarnation 1\) "
                                                   r"stopped beating .* s ago .*: lost"):
        running.check()


@pytest.fixture
def rendezvous() -> Iterator[tuple[int, dist.Store]]:
    with rendezvous_in_thread() as served:
        yield served


def _joins(port: int, node: int, incarnation: int) -> NodeJoins:
    """A rank's joins on rail 0 of a job of 3 one-rank nodes (no gossip: what a join does
    before it touches one)."""
    seat = LinkedSeat(node=node, nodes=3, rank=node, world_size=3, procs_per_node=1,
                      incarnation=incarnation, rendezvous=f"127.0.0.1:{port}",
                      timeout_s=60.0, starting=3)
    return NodeJoins(seat, SimpleNamespace(topology=SimpleNamespace(procs_per_node=1)))


def test_a_rank_that_closes_says_it_left(rendezvous) -> None:
    port, store = rendezvous
    joins = _joins(port, node=2, incarnation=1)
    assert not has_left(joins.store, 2, 1)
    joins.close()
    assert has_left(joins.store, 2, 1)
    assert not has_left(dist.PrefixStore("qcomm/linked/rail1/", store), 2, 1)


def test_a_rank_whose_optimizer_is_built_again_runs_again(rendezvous) -> None:
    """An optimizer closed, then another built on the same seat in the same process (same
    incarnation): the rank offers states again, so it no longer counts as left."""
    port, _ = rendezvous
    _joins(port, node=0, incarnation=1).close()
    again = _joins(port, node=0, incarnation=1)
    assert not has_left(again.store, 0, 1)


def test_a_node_back_after_every_other_left_stops_waiting_within_seconds(rendezvous) -> None:
    """Its bound is 60 s; the check runs with the wait's first line (5 s)."""
    port, store = rendezvous
    for member in (0, 1, 1, 2):             # node 1 comes back: incarnation 2
        claim_incarnation(store, member)
    for member in (0, 2):
        _joins(port, node=member, incarnation=1).close()
    t0 = time.monotonic()
    with pytest.raises(NoRunningMemberError, match=r"member 0 \(incarnation 1\) left the job; "
                                                   r"member 2 \(incarnation 1\) left the job"):
        _joins(port, node=1, incarnation=2).join()
    assert time.monotonic() - t0 < 15


def test_a_state_offered_while_a_member_runs_is_taken(rendezvous) -> None:
    """The check lets the wait go on while member 0 beats; its offer ends it."""
    _, store = rendezvous
    for member in (0, 1, 1, 2):
        claim_incarnation(store, member)
    _beat(store, 0, 1)
    rail = dist.PrefixStore("qcomm/linked/rail0/", store)
    leave(rail, 2, 1)
    running = RunningMembers(store, rail, {0: 0, 2: 2}, silence_s=60)
    seq = announce(rail, 1, 2)
    late = threading.Timer(6.0, offer_state, args=(rail, seq, b"state"))
    late.start()
    try:
        assert await_state(rail, seq, 30, check=running.check) == b"state"
    finally:
        late.join()
