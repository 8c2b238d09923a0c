"""A lost gossip member with ``on_peer_loss="continue"``: its neighbours drop it, the ring closes
over the gap, the survivors keep mixing with their mean preserved, and their exact sum leaves the
lost one out. In the deterministic simulator (lock step, messages one tick late) and with members
as threads.
"""

from __future__ import annotations

import time

import pytest
import torch

from qcomm.collectives.errors import PeerLostError, PeerTimeoutError
from qcomm.collectives.gossip import WaitFreeGossip
from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
from qcomm.compress import QuantSpec

NUMEL = 1024
SPEC = QuantSpec(4, 128, "stochastic")


def _start(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


def _mean(xs: list[torch.Tensor], members: list[int]) -> torch.Tensor:
    return torch.stack([xs[i].double() for i in members]).mean(0)


def _settled_mean(sim: WaitFreeSimulator, xs: list[torch.Tensor],
                  members: list[int]) -> torch.Tensor:
    """The members' mean once every message is applied and every mirror term owed is added
    (:meth:`WaitFreeGossip.settle`): what the paired mixing preserves at every moment is the
    mean of x plus what is owed and in flight."""
    sim.drain()
    for i in members:
        sim.members[i].settle(xs[i])
    return _mean(xs, members)


def _sim(n: int, **kwargs) -> WaitFreeSimulator:
    kw = dict(delay=1, spec=SPEC, staleness=1, gamma=0.3, on_peer_loss="continue")
    kw.update(kwargs)
    return WaitFreeSimulator(n, NUMEL, **kw)


def _live_peers(m: WaitFreeGossip) -> list[int]:
    return sorted(m.peers[k] for k in m.membership.live_links())


def _kill_and_settle(sim: WaitFreeSimulator, xs: list[torch.Tensor], dead: list[int],
                     *, after_sending: bool) -> None:
    """Kill ``dead`` at tick 20 (before its round of that tick, or right after it), then run
    until every survivor has dropped them and the closing edges joined the mixing."""
    sim.run(xs, 20)
    if after_sending:
        sim.run(xs, 1)   # its round of this tick is on the wire when it dies
    for i in dead:
        sim.kill(i)
    sim.run(xs, 4)


def _check_ring_closed(sim: WaitFreeSimulator, dead: list[int]) -> None:
    survivors = [i for i in range(sim.n) if i not in dead]
    for pos, i in enumerate(survivors):
        m = sim.members[i]
        ring = {survivors[pos - 1], survivors[(pos + 1) % len(survivors)]}
        assert set(_live_peers(m)) == ring - {i}
        # every neighbour it now mixes with is one whose copy it set up from a hello or held
        assert all(m.membership.links[k].greeted for k in m.membership.live_links())


@pytest.mark.parametrize("after_sending", [False, True])
def test_a_member_killed_mid_run_is_dropped_and_the_ring_closes(after_sending: bool) -> None:
    sim = _sim(5)
    xs = _start(5)
    sim.run(xs, 20 + after_sending)
    rounds_at_death = sim.members[2].rounds_started
    sim.kill(2)
    sim.run(xs, 4)
    _check_ring_closed(sim, [2])
    for i in (1, 3):   # the two that saw it die
        m = sim.members[i]
        assert m.lost == {2}
        assert [e["member"] for e in m.losses] == [2]
        assert m.losses[0]["error"] == "PeerLostError"
        assert m.live_members() == 4
    for i in (0, 4):   # the others were not its neighbours: nothing changed for them
        assert sim.members[i].lost == set()
    # Every message the dead member sent before dying was taken (none lost on the wire).
    assert [e["round"] >= rounds_at_death for e in sim.members[1].losses] == [True]


@pytest.mark.parametrize(("n", "dead", "staleness", "fragments"), [
    (4, [2], 1, 1), (5, [1, 3], 1, 1), (5, [1, 2], 1, 1), (5, [2], 2, 2), (6, [0, 1, 4], 1, 2),
])
def test_after_the_drop_mixing_preserves_the_survivors_mean_and_reaches_consensus(
        n: int, dead: list[int], staleness: int, fragments: int) -> None:
    sim = _sim(n, staleness=staleness, delay=staleness, fragments=fragments)
    xs = _start(n)
    survivors = [i for i in range(n) if i not in dead]
    start = sim.consensus_distance([xs[i] for i in survivors])
    _kill_and_settle(sim, xs, dead, after_sending=False)
    sim.run(xs, staleness + 1)
    _check_ring_closed(sim, dead)
    before = _settled_mean(sim, xs, survivors)
    for _ in range(20):
        sim.run(xs, 10)
        # each later mixing step moves the survivors' mean by float32 rounding only
        drift = float((_settled_mean(sim, xs, survivors) - before).norm())
        assert drift < 2e-6 * float(before.norm()), drift
    sim.run(xs, 200)
    sim.drain()
    assert sim.consensus_distance([xs[i] for i in survivors]) < 1e-4 * start


def test_two_adjacent_members_lost_close_the_ring_over_both() -> None:
    # Member 0 sees 1 die and tries 2, which is dead too: it moves on to 3.
    sim = _sim(5)
    xs = _start(5)
    _kill_and_settle(sim, xs, [1, 2], after_sending=True)
    _check_ring_closed(sim, [1, 2])
    assert sim.members[0].lost == {1, 2} and sim.members[3].lost == {1, 2}
    assert sim.members[0].live_members() == 3


def test_with_raise_the_loss_is_the_named_error_and_nothing_is_applied() -> None:
    sim = _sim(4, on_peer_loss="raise")
    xs = _start(4)
    sim.run(xs, 10)
    sim.kill(2)
    m = sim.members[1]
    sim.now += 1  # the messages it sent before dying arrive
    before = (m._links.copies.clone(), list(m.received), m.steps)
    with pytest.raises(PeerLostError) as err:
        m.prepare()
    assert err.value.peers == [2] and err.value.link == "inter"
    assert torch.equal(m._links.copies, before[0]) and m.received == before[1]
    assert m.steps == before[2]


def test_a_state_saved_after_the_drop_resumes_bit_exact() -> None:
    kwargs = dict(periods=[1, 2, 1, 1, 3], fragments=2, outer_momentum=0.5)
    a = _sim(5, **kwargs)
    xs = _start(5)
    _kill_and_settle(a, xs, [3], after_sending=False)
    a.run(xs, 6)
    a.drain()
    states = [None if i == 3 else m.state_dict() for i, m in enumerate(a.members)]
    assert states[2]["lost"] == [3] and states[2]["peers"] == [1, 4]
    saved = [x.clone() for x in xs]
    b = _sim(5, **kwargs)
    b.now = a.now
    b.load_state_dicts(states)
    a.run(xs, 30)
    b.run(saved, 30)
    for i in (0, 1, 2, 4):
        assert torch.equal(xs[i], saved[i])


def _threads_world(n: int, dead: int, body_steps: int, timeout_s: float = 20.0):
    world = MemoryWorld(n, timeout_s=60)

    def body(rank: int) -> dict:
        group = world.group(list(range(n)), rank)
        g = WaitFreeGossip(list(range(n)), group, NUMEL, spec=SPEC, gamma=0.3,
                           timeout_s=timeout_s, on_peer_loss="continue")
        x = torch.full((NUMEL,), float(rank + 1))
        for step in range(body_steps):
            if rank == dead and step == body_steps // 3:
                group.mailboxes.kill(rank)   # its connections break
                return {}
            g.prepare()
            g.end_step(x)
            time.sleep(0.002)
        g.drain()
        total, count = g.survivors_sum(x)
        out = {"x": x.clone(), "total": total, "count": count, "lost": set(g.lost),
               "live": g.live_members(), "dropped": [e["member"] for e in g.losses]}
        g.close()
        return out

    return world.run(body, timeout_s=60)


def test_threads_survive_a_killed_member_and_sum_exactly_over_the_survivors() -> None:
    res = _threads_world(4, dead=1, body_steps=60)
    survivors = [r for i, r in enumerate(res) if i != 1]
    expect = survivors[0]["x"].clone()
    for r in survivors[1:]:
        expect += r["x"]
    for r in survivors:
        assert r["count"] == 3
        # the same bits on every survivor, and the sum of exactly the three of them
        assert torch.equal(r["total"], survivors[0]["total"])
        torch.testing.assert_close(r["total"], expect, rtol=1e-6, atol=1e-5)
    # its neighbours dropped it; the sum told the third one
    assert res[0]["dropped"] == [1] and res[2]["dropped"] == [1] and res[3]["dropped"] == []
    assert all(r["lost"] == {1} and r["live"] == 3 for r in survivors)


def test_a_silent_member_is_dropped_after_the_timeout() -> None:
    n, timeout_s = 3, 0.5
    world = MemoryWorld(n, timeout_s=60)

    def body(rank: int) -> dict:
        g = WaitFreeGossip(list(range(n)), world.group(list(range(n)), rank), NUMEL, spec=SPEC,
                           timeout_s=timeout_s, on_peer_loss="continue")
        x = torch.zeros(NUMEL)
        if rank == 2:
            g.prepare()
            g.end_step(x)
            time.sleep(6 * timeout_s)   # silent, never closes
            return {}
        t0 = time.monotonic()
        while not g.lost:
            g.prepare()
            g.end_step(x)
            time.sleep(0.01)
        return {"after": time.monotonic() - t0, "error": g.losses[0]["error"]}

    res = world.run(body, timeout_s=30)
    for r in res[:2]:
        assert r["error"] == PeerTimeoutError.__name__
        assert timeout_s <= r["after"] < timeout_s + 1.5


def test_the_survivors_restarted_alone_resume_bit_exact() -> None:
    # 5 members, member 3 lost; the survivors save and a 4-member run loads their states: it
    # goes on with their old numbers (seeds, seals, links) exactly as the 5-member run does.
    kwargs = dict(fragments=2, outer_momentum=0.5)
    a = _sim(5, **kwargs)
    xs = _start(5)
    _kill_and_settle(a, xs, [3], after_sending=False)
    a.run(xs, 6)
    a.drain()
    states = [m.state_dict() for i, m in enumerate(a.members) if i != 3]
    survivors = [0, 1, 2, 4]
    saved = [xs[i].clone() for i in survivors]
    b = _sim(4, **kwargs)
    b.now = a.now
    b.load_state_dicts(states)
    assert [m.member for m in b.members] == survivors and b.members[3].lost == {3}
    a.run(xs, 30)
    b.run(saved, 30)
    for i, x in zip(survivors, saved, strict=True):
        assert torch.equal(xs[i], x)


def test_a_state_that_is_not_of_this_group_or_its_survivors_is_refused() -> None:
    a = _sim(5)
    xs = _start(5)
    _kill_and_settle(a, xs, [3], after_sending=False)
    a.drain()
    st = a.members[4].state_dict()
    b = _sim(3)   # not the 4 survivors
    before = b.members[2].membership.slots[:]
    with pytest.raises(ValueError, match="lost members"):
        b.members[2].load_state_dict(st)
    assert b.members[2].membership.slots == before and b.members[2].member == 2


@pytest.mark.parametrize(("graph", "n", "dead"), [("exponential", 8, [3]),
                                                  ("exponential", 8, [3, 4]),
                                                  ("complete", 5, [1])])
def test_other_graphs_stay_connected_and_keep_the_survivors_mean(graph: str, n: int,
                                                                 dead: list[int]) -> None:
    sim = _sim(n, graph=graph)
    xs = _start(n)
    survivors = [i for i in range(n) if i not in dead]
    start = sim.consensus_distance([xs[i] for i in survivors])
    _kill_and_settle(sim, xs, dead, after_sending=False)
    sim.run(xs, 2)
    for i in survivors:   # no live link to the dead; the ring neighbours among the links
        live = _live_peers(sim.members[i])
        assert not set(live) & set(dead)
        pos = survivors.index(i)
        assert {survivors[pos - 1], survivors[(pos + 1) % len(survivors)]} <= set(live)
    before = _settled_mean(sim, xs, survivors)
    sim.run(xs, 100)
    drift = float((_settled_mean(sim, xs, survivors) - before).norm())
    assert drift < 2e-6 * float(before.norm()), drift
    sim.run(xs, 100)
    sim.drain()
    assert sim.consensus_distance([xs[i] for i in survivors]) < 1e-4 * start


def test_a_bad_on_peer_loss_names_itself() -> None:
    with pytest.raises(ValueError, match="on_peer_loss"):
        _sim(2, on_peer_loss="retry")


def test_the_sum_tells_every_member_who_took_part() -> None:
    """A member that believes another lost (a joiner next to others, whose join it has not
    seen yet) learns from the sum over the live ones that it took part, and tells nobody it
    is lost: every member reports the same live members at the end."""
    n = 5
    world = MemoryWorld(n, timeout_s=60)

    def body(rank: int) -> dict:
        g = WaitFreeGossip(list(range(n)), world.group(list(range(n)), rank), NUMEL, spec=SPEC,
                           gamma=0.3, timeout_s=20, on_peer_loss="continue")
        x = torch.full((NUMEL,), float(rank + 1))
        for _ in range(6):
            g.prepare()
            g.end_step(x)
        g.drain()
        if rank == 1:
            g.membership.lost = {3}   # not its neighbour: its links stay 0 and 2
        total, count = g.survivors_sum(x)
        out = {"count": count, "lost": set(g.lost), "live": g.live_members(), "total": total}
        g.close()
        return out

    res = world.run(body, timeout_s=60)
    assert all(r["count"] == n and r["live"] == n and r["lost"] == set() for r in res), \
        [(r["count"], r["live"], r["lost"]) for r in res]
    assert all(torch.equal(r["total"], res[0]["total"]) for r in res)
