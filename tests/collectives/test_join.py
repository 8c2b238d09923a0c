"""A member joining a running wait-free gossip (:mod:`qcomm.collectives.gossip.joining`): a lost
member comes back, the ring opens to it (the link that spanned its gap is retired at both ends,
every term on it mirrored), the mixing moves no mass through the join, and the joiner is as close
to the mean as the running members. In the deterministic simulator, with messages in flight."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip.joining import admit, join_state, start_joined, start_without
from qcomm.collectives.memory import WaitFreeSimulator
from qcomm.compress import QuantSpec

from .test_peer_loss import NUMEL, _live_peers, _sim, _start


def _settled_sum(sim: WaitFreeSimulator, xs: list[torch.Tensor],
                 members: list[int]) -> torch.Tensor:
    """float64 sum of the members' x once every message is applied and every mirror owed is
    added: what the paired mixing preserves."""
    sim.drain()
    for i in members:
        sim.members[i].settle(xs[i])
    return torch.stack([xs[i].double() for i in members]).sum(0)


def _check_ring(sim: WaitFreeSimulator, members: list[int]) -> None:
    for pos, i in enumerate(members):
        ring = {members[pos - 1], members[(pos + 1) % len(members)]} - {i}
        assert _live_peers(sim.members[i]) == sorted(ring), i


def test_a_lost_member_rejoins_and_the_ring_opens_to_it() -> None:
    sim = _sim(5)
    xs = _start(5)
    sim.run(xs, 20)
    sim.kill(2)
    sim.run(xs, 5)
    _check_ring(sim, [0, 1, 3, 4])          # closed over the gap
    sim.join(2, xs)
    # the joiner starts where its donor (member 1, below it) is
    assert torch.equal(xs[2], xs[1])
    assert sim.members[2].rounds_started == sim.members[1].rounds_started
    sim.run(xs, 4)
    _check_ring(sim, [0, 1, 2, 3, 4])       # opened: 1-3 retired at both ends, 1-2, 2-3 live
    for i, m in enumerate(sim.members):
        assert m.lost == set(), i
        assert m.live_members() == 5
        assert all(m.membership.links[k].greeted for k in m.membership.live_links())
    # the retired link is not a loss: one loss each on 1 and 3 (member 2's death), no more
    assert [len(m.losses) for m in sim.members] == [0, 1, 0, 1, 0]
    sim.run(xs, 10)
    # the joiner takes part: its neighbours have applied its rounds
    assert sim.members[1].rounds_received()[2] >= sim.members[2].rounds_started - 2


@pytest.mark.parametrize(("staleness", "fragments", "delay", "periods"), [
    (1, 1, 1, None), (2, 2, 2, None), (1, 4, 3, None), (1, 1, 2, [1, 1, 1, 3, 1]),
])
def test_the_mixing_moves_no_mass_through_a_join(staleness: int, fragments: int, delay: int,
                                                 periods: list[int] | None) -> None:
    """Sum of the settled x after the join and 30 more ticks = sum before + the joiner's
    start (its donor's x at the join), to float32 rounding: the retire closes the old link
    with every term mirrored, the new links start from hellos. Messages are in flight when
    the member joins."""
    sim = _sim(5, staleness=staleness, fragments=fragments, delay=delay, periods=periods)
    xs = _start(5)
    sim.run(xs, 20)
    sim.kill(2)
    sim.run(xs, 8)
    before = _settled_sum(sim, xs, [0, 1, 3, 4])
    sim.run(xs, 3)                 # rounds on the wire again
    sim.join(2, xs)
    added = xs[2].double().clone()
    for _ in range(3):
        sim.run(xs, 10)
        after = _settled_sum(sim, xs, list(range(5)))
        drift = float((after - before - added).norm())
        assert drift < 2e-6 * float(before.norm()), drift
    _check_ring(sim, [0, 1, 2, 3, 4])


@pytest.mark.parametrize(("graph", "fragments"), [("ring", 1), ("ring", 2),
                                                   ("exponential", 1)])
def test_a_member_that_was_never_there_joins_later(graph: str, fragments: int) -> None:
    """A job of 6 seats starts with members 3 and 5 absent: the present ones link to their
    nearest present neighbours in their place (symmetric), mix without moving mass, and the
    absent one that starts later joins as a lost one would."""
    sim = _sim(6, graph=graph, fragments=fragments, delay=1)
    xs = _start(6)
    absent = {3, 5}
    for i in sorted(absent):
        sim.kill(i)                   # never runs until it joins
    for i in sorted(set(range(6)) - absent):
        start_without(sim.members[i], absent)
    present = [0, 1, 2, 4]
    links = {i: set(_live_peers(sim.members[i])) for i in present}
    assert all(i in links[j] for i in present for j in links[i]), links   # symmetric
    if graph == "ring":
        _check_ring(sim, present)
    start = torch.stack([xs[i].double() for i in present]).sum(0)
    sim.run(xs, 30)
    drift = float((_settled_sum(sim, xs, present) - start).norm())
    assert drift < 2e-6 * float(start.norm()), drift
    assert [sim.members[i].live_members() for i in present] == [4, 4, 4, 4]
    assert sum(len(sim.members[i].losses) for i in present) == 0   # absent is not a loss
    before = _settled_sum(sim, xs, present)
    sim.join(3, xs)
    added = xs[3].double().clone()
    sim.run(xs, 30)
    members = [0, 1, 2, 3, 4]
    drift = float((_settled_sum(sim, xs, members) - before - added).norm())
    assert drift < 2e-6 * float(before.norm()), drift
    if graph == "ring":
        _check_ring(sim, members)
    assert [sim.members[i].live_members() for i in members] == [5] * 5


def test_a_member_not_told_of_a_join_admits_it_when_its_link_is_retired() -> None:
    """Member 3 is not told that 2 joins (its news comes from elsewhere, late): member 1's
    retire of the 1-3 link makes it ask (``on_unknown_join``) before the link closes, so it
    links to the joiner instead of being left with one link; no mass moves."""
    sim = _sim(5)
    xs = _start(5)
    sim.run(xs, 20)
    sim.kill(2)
    sim.run(xs, 8)
    before = _settled_sum(sim, xs, [0, 1, 3, 4])
    asked = []
    sim.members[3].membership.on_unknown_join = lambda: (asked.append(1),
                                                         admit(sim.members[3], 2))
    sim.boxes.revive(2)
    sim.killed.discard(2)
    joiner = sim._make(2)
    start_joined(joiner, join_state(sim.members[1]))
    xs[2].copy_(xs[1])
    sim.members[2] = joiner
    added = xs[2].double().clone()
    for j in (0, 1, 4):               # everyone but member 3
        admit(sim.members[j], 2)
    sim.run(xs, 30)
    assert asked == [1]
    _check_ring(sim, [0, 1, 2, 3, 4])
    drift = float((_settled_sum(sim, xs, list(range(5))) - before - added).norm())
    assert drift < 2e-6 * float(before.norm()), drift


def test_start_without_after_a_round_is_refused() -> None:
    sim = _sim(3)
    xs = _start(3)
    sim.run(xs, 2)
    with pytest.raises(RuntimeError, match="start_without\\(\\) must come before"):
        start_without(sim.members[0], {2})


def test_after_a_join_the_members_reach_consensus() -> None:
    sim = _sim(5, fragments=2)
    xs = _start(5)
    sim.run(xs, 20)
    sim.kill(3)
    sim.run(xs, 10)
    sim.join(3, xs)
    start = sim.consensus_distance(xs)
    sim.run(xs, 300)
    sim.drain()
    assert sim.consensus_distance(xs) < 1e-3 * start


def _drifting_update(targets: list[torch.Tensor]):
    """A local step pulling each member to its own target, with noise: the members stay
    apart, as with data of their own."""
    def update(i: int, x: torch.Tensor, step: int) -> None:
        g = torch.Generator().manual_seed(1000 * i + step)
        x.sub_(0.05 * (x - targets[i]) + 0.01 * torch.randn(NUMEL, generator=g))
    return update


@pytest.mark.parametrize(("fragments", "periods"), [(1, None), (4, None), (4, [1, 1, 2, 1, 1])])
def test_two_rounds_after_its_join_the_joiner_is_as_close_to_the_mean_as_the_others(
        fragments: int, periods: list[int] | None) -> None:
    """The joiner starts from its neighbour's x; two of its rounds later it is no farther
    from the members' mean than twice the farthest running member (``-s`` prints the
    ratio)."""
    g = torch.Generator().manual_seed(0)
    targets = [torch.randn(NUMEL, generator=g) for _ in range(5)]
    update = _drifting_update(targets)
    sim = _sim(5, spec=QuantSpec(2, 128, "stochastic"), gamma=None, fragments=fragments,
               round_period=fragments, periods=periods)
    xs = [torch.zeros(NUMEL) for _ in range(5)]
    sim.run(xs, 100, update)
    sim.kill(2)
    sim.run(xs, 100, update)
    sim.join(2, xs)
    period = (periods or [1] * 5)[2]
    sim.run(xs, 2 * fragments * period, update)
    v = torch.stack([x.double() for x in xs])
    far = (v - v.mean(0)).norm(dim=1)
    ratio = float(far[2]) / float(max(far[i] for i in (0, 1, 3, 4)))
    print(f"joiner's distance to the mean / the farthest running member's: {ratio:.2f}")
    assert ratio <= 2, far


def test_a_join_while_another_member_is_lost() -> None:
    """Member 2 joins at the tick member 4 dies: 3 and 5 close the ring over 4 while 1 and 3
    open it to 2; the mass of the live members is kept."""
    sim = _sim(6)
    xs = _start(6)
    sim.run(xs, 20)
    sim.kill(2)
    sim.run(xs, 8)
    before = _settled_sum(sim, xs, [0, 1, 3, 4, 5])
    lost_mass = xs[4].double().clone()   # settled: what member 4 holds when it dies
    sim.join(2, xs)
    added = xs[2].double().clone()
    sim.kill(4)
    sim.run(xs, 10)
    _check_ring(sim, [0, 1, 2, 3, 5])
    after = _settled_sum(sim, xs, [0, 1, 2, 3, 5])
    # 4 died right after a drain (nothing of it in flight, nothing owed to or by it): the
    # survivors and the joiner hold exactly what they held, plus the joiner's start
    assert float((after - (before + added - lost_mass)).norm()) < 2e-6 * float(before.norm())
    sim.run(xs, 300)
    sim.drain()
    live = [xs[i] for i in (0, 1, 2, 3, 5)]
    assert sim.consensus_distance(live) < 1e-3


def test_two_members_join_at_once() -> None:
    sim = _sim(6, fragments=2)
    xs = _start(6)
    sim.run(xs, 20)
    sim.kill(1)
    sim.kill(4)
    sim.run(xs, 8)
    _check_ring(sim, [0, 2, 3, 5])
    before = _settled_sum(sim, xs, [0, 2, 3, 5])
    sim.join(1, xs)
    sim.join(4, xs)
    added = xs[1].double() + xs[4].double()
    sim.run(xs, 20)
    _check_ring(sim, list(range(6)))
    after = _settled_sum(sim, xs, list(range(6)))
    assert float((after - before - added).norm()) < 2e-6 * float(before.norm())


def test_adjacent_members_join_one_after_the_other() -> None:
    """1 and 2 were lost (0 linked to 3); 2 joins, then 1 while 2's links are opening."""
    sim = _sim(5)
    xs = _start(5)
    sim.run(xs, 20)
    sim.kill(1)
    sim.kill(2)
    sim.run(xs, 10)
    _check_ring(sim, [0, 3, 4])
    before = _settled_sum(sim, xs, [0, 3, 4])
    sim.join(2, xs)
    added = xs[2].double().clone()
    sim.run(xs, 1)
    sim.join(1, xs)
    added += xs[1].double()
    sim.run(xs, 20)
    _check_ring(sim, list(range(5)))
    after = _settled_sum(sim, xs, list(range(5)))
    assert float((after - before - added).norm()) < 2e-6 * float(before.norm())


def test_a_join_state_of_another_gossip_is_refused_and_changes_nothing() -> None:
    sim = _sim(4)
    xs = _start(4)
    sim.run(xs, 10)
    state = join_state(sim.members[1])
    other = _sim(4, fragments=2)
    joiner = other.members[2]
    with pytest.raises(ValueError, match="fragments"):
        start_joined(joiner, state)
    assert joiner.rounds_started == 0 and _live_peers(joiner) == [1, 3]
    bad_gamma = _sim(4, gamma=0.2).members[2]
    with pytest.raises(ValueError, match="gamma"):
        start_joined(bad_gamma, state)
    with pytest.raises(ValueError, match="join_state"):
        start_joined(joiner, {"rounds": 3})


def test_a_join_before_any_round_or_into_a_running_member_is_refused() -> None:
    sim = _sim(4)
    with pytest.raises(RuntimeError, match="first round"):
        join_state(sim.members[0])
    xs = _start(4)
    sim.run(xs, 5)
    with pytest.raises(RuntimeError, match="first round"):
        start_joined(sim.members[2], join_state(sim.members[1]))
    with pytest.raises(ValueError, match="running"):
        sim.join(2, xs)
    with pytest.raises(ValueError, match="member must be another member"):
        admit(sim.members[0], 0)
    with pytest.raises(ValueError, match="member must be another member"):
        admit(sim.members[0], 4)


def test_a_member_that_leaves_with_a_goodbye_is_not_a_loss_and_can_come_back() -> None:
    """``close()`` says goodbye after the last message: its neighbours apply what came before
    it, close their links to it (no loss recorded, no ring closed over it: a ring less one
    member is still connected) and count it out; it can join again later."""
    sim = _sim(5)
    xs = _start(5)
    sim.run(xs, 20)
    sim.members[2].close()
    sim.killed.add(2)            # it takes no more steps (not a killed connection)
    sim.run(xs, 3)
    for i in (1, 3):
        m = sim.members[i]
        assert 2 not in _live_peers(m) and m.lost == {2}, i
        assert m.losses == [] and m.live_members() == 4
    assert _live_peers(sim.members[1]) == [0] and _live_peers(sim.members[3]) == [4]
    sim.run(xs, 10)              # the others go on, along the path 3-4-0-1
    sim.join(2, xs)
    sim.run(xs, 5)
    _check_ring(sim, list(range(5)))
    assert all(m.losses == [] for m in sim.members)


@pytest.mark.parametrize("n", [4, 5, 6])
def test_a_retired_link_that_fails_before_its_retire_exchange_ends_is_no_loss(n: int) -> None:
    """Member 2 joins between 1 and 3, which retire their link; it breaks before the retires
    arrive (its transport aborted, both ends running). Each end closes it as the exchange
    would have: no loss, the ring is the whole ring, and when 2 is lost again later, 1 and 3
    close the ring over it to each other (not to a member further on)."""
    sim = _sim(n)
    xs = _start(n)
    sim.run(xs, 20)
    sim.kill(2)
    sim.run(xs, 8)
    sim.join(2, xs)                  # 1 and 3 retire 1-3: their retires are on the wire
    assert all(sim.members[i].membership.links[k].retiring for i, j in ((1, 3), (3, 1))
               for k in sim.members[i].membership.live_links()
               if sim.members[i].peers[k] == j)
    sim.boxes.cut(1, 3)              # the retires are lost with the connection
    sim.run(xs, 10)
    everyone = list(range(n))
    _check_ring(sim, everyone)
    for i, m in enumerate(sim.members):
        assert m.lost == set() and m.live_members() == n, i
    # the only losses: member 2's death, on 1 and 3
    assert [len(m.losses) for m in sim.members] == [0, 1, 0, 1] + [0] * (n - 4)
    sim.boxes.mend(1, 3)
    sim.kill(2)
    sim.run(xs, 10)
    survivors = [i for i in everyone if i != 2]
    _check_ring(sim, survivors)
    for i in (1, 3):   # 2's neighbours saw it lost (the others learn it at a drain)
        assert sim.members[i].live_members() == n - 1 and sim.members[i].lost == {2}, i
