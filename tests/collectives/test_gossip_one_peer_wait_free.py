"""The wait-free gossip on the one-peer graph (OnePeerWaitFree) in the in-memory worlds: every
link's copies exact at both ends, no message lost or applied twice, the mean kept by the
paired terms at any pace, losses and joins, checkpoints, a corrupt message."""

from __future__ import annotations

import time

import pytest
import torch

from qcomm.collectives.errors import CorruptPayloadError
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.gossip.schedules import hops
from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
from qcomm.compress import QuantSpec

SPEC = QuantSpec(4, 128, "stochastic")
NUMEL = 256
GRAPH = "one-peer-exp"


def _start(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) for _ in range(n)]


def _mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).to(torch.float64).mean(0)


def _settled(sim: WaitFreeSimulator, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Drain, add what is owed: the members' x then hold their whole mass."""
    sim.drain()
    live = [i for i in range(sim.n) if i not in sim.killed]
    for i in live:
        sim.members[i].settle(xs[i])
    return [xs[i] for i in live]


def _links_exact(members: list[OnePeerWaitFree], lost: set[int] = frozenset()) -> int:
    """Assert that both ends of every live link hold the same copies, bit for bit, and that
    every message sent was applied once (counts equal); returns the links checked."""
    checked = 0
    for m in members:
        if m.member in lost:
            continue
        for p in m.live_links():
            mine, theirs = m.links[p], members[p].links[m.member]
            assert mine.sent == theirs.received, (m.member, p)
            assert torch.equal(mine.fresh, theirs.theirs), (m.member, p)
            checked += 1
    return checked


@pytest.mark.parametrize(("periods", "delay", "fragments", "ticks"),
                         [(None, 2, 1, 60), ([3, 1, 1, 2, 1, 5, 1, 1], 1, 2, 100)],
                         ids=["delay-2", "mixed-paces-fragments-2"])
def test_every_message_is_applied_once_in_order_and_the_mean_is_kept(
        periods: list[int] | None, delay: int, fragments: int, ticks: int) -> None:
    # (the member of period 5 takes 20 rounds in 100 ticks: 3 or 4 per link and fragment)
    n = 8
    sim = WaitFreeSimulator(n, NUMEL, graph=GRAPH, spec=SPEC, periods=periods, delay=delay,
                            fragments=fragments)
    xs = _start(n)
    mean0, d0 = _mean(xs), sim.consensus_distance(xs)
    sim.run(xs, ticks)
    xs = _settled(sim, xs)
    assert _links_exact(sim.members) == n * hops(n)
    drift = float((_mean(xs) - mean0).abs().max())
    assert drift < 2e-6, drift
    assert sim.consensus_distance(xs) < 0.05 * d0
    # one message per round with a partner, nothing else on the wire but the markers
    for m in sim.members:
        assert sum(link.sent for link in m.links.values()) == m.rounds_started


def test_eight_members_reach_consensus_in_fewer_rounds_than_the_ring() -> None:
    n, rounds = 8, 45   # to 1e-3 at 1024 floats: 41 rounds, the ring 99 (bench/RESULTS.md)
    dist = {}
    for graph in ("ring", GRAPH):
        sim = WaitFreeSimulator(n, NUMEL, graph=graph, spec=SPEC, delay=1)
        xs = _start(n)
        d0 = sim.consensus_distance(xs)
        sim.run(xs, rounds)
        dist[graph] = sim.consensus_distance(xs) / d0
    assert dist[GRAPH] < 2e-3 and dist["ring"] > 10 * dist[GRAPH], dist


def test_a_member_ten_times_slower_holds_nobody_back_and_converges() -> None:
    n = 4
    periods = [10] + [1] * (n - 1)
    sim = WaitFreeSimulator(n, NUMEL, graph=GRAPH, spec=SPEC, periods=periods, delay=1)
    xs = _start(n)
    d0 = sim.consensus_distance(xs)
    sim.run(xs, 200)
    assert sim.members[1].rounds_started == 200 and sim.members[0].rounds_started == 20
    xs = _settled(sim, xs)
    assert sim.consensus_distance(xs) < 1e-2 * d0
    # a fast member adds at most one term per version of the slow one's copy
    for p in sim.members[0].peers:
        assert sim.members[p].links[0].terms <= sim.members[0].links[p].sent


def test_a_lost_member_is_dropped_and_the_survivors_keep_their_sum_and_agree() -> None:
    n = 8
    sim = WaitFreeSimulator(n, NUMEL, graph=GRAPH, spec=SPEC, delay=1,
                            on_peer_loss="continue", timeout_s=5)
    xs = _start(n)
    sim.run(xs, 10)
    sim.kill(5)
    sim.run(xs, 8)   # every peer of 5 finds the broken link
    for p in sim.members[5].peers:
        assert 5 in sim.members[p].lost and sim.members[p].losses[0]["member"] == 5
    xs_live = _settled(sim, list(xs))
    live = [i for i in range(n) if i != 5]
    mean1, d1 = _mean(xs_live), sim.consensus_distance(xs_live)
    sim.run(xs, 60)
    xs_live = _settled(sim, xs)
    assert float((_mean(xs_live) - mean1).abs().max()) < 2e-6
    assert sim.consensus_distance(xs_live) < 1e-2 * d1
    assert _links_exact(sim.members, {5}) == n * hops(n) - 2 * hops(n)   # 5's links gone
    assert all(sim.members[i].live_links() == [p for p in sim.members[i].peers if p != 5]
               for i in live)


def test_a_lost_member_joins_again_on_new_links_and_ends_with_the_others() -> None:
    n = 8
    sim = WaitFreeSimulator(n, NUMEL, graph=GRAPH, spec=SPEC, delay=1,
                            on_peer_loss="continue", timeout_s=5)
    xs = _start(n)
    sim.run(xs, 10)
    sim.kill(3)
    sim.run(xs, 8)
    sim.join(3, xs)   # starts from member 2's clock and x, on new links from zero
    assert sim.members[3].rounds_started == sim.members[2].rounds_started
    for p in sim.members[3].peers:
        assert 3 not in sim.members[p].lost and sim.members[p].links[3].received == 0
    xs = _settled(sim, xs)
    mean1, d1 = _mean(xs), sim.consensus_distance(xs)
    sim.run(xs, 60)
    xs = _settled(sim, xs)
    assert _links_exact(sim.members) == n * hops(n)
    assert float((_mean(xs) - mean1).abs().max()) < 2e-6
    assert sim.consensus_distance(xs) < 1e-2 * d1
    assert [e["member"] for e in sim.members[2].returns] == [3]


def test_state_after_a_drain_resumes_bit_exact() -> None:
    kwargs = dict(graph=GRAPH, periods=[3, 1, 1, 2], delay=1, spec=SPEC, fragments=2,
                  outer_momentum=0.5)
    a = WaitFreeSimulator(4, NUMEL, **kwargs)
    xs = _start(4)
    a.run(xs, 30)
    a.drain()
    states = [m.state_dict() for m in a.members]
    b = WaitFreeSimulator(4, NUMEL, **kwargs)
    b.now = a.now
    b.load_state_dicts([{k: v for k, v in s.items()} for s in states])
    ys = [x.clone() for x in xs]
    a.run(xs, 25)
    b.run(ys, 25)
    assert all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_state_without_a_drain_or_of_another_gossip_is_refused() -> None:
    sim = WaitFreeSimulator(4, NUMEL, graph=GRAPH, spec=SPEC)
    sim.run(_start(4), 3)
    with pytest.raises(RuntimeError, match="needs drain"):
        sim.members[0].state_dict()
    sim.drain()
    state = sim.members[0].state_dict()
    other = WaitFreeSimulator(4, NUMEL, graph=GRAPH, spec=SPEC, fragments=2).members[0]
    with pytest.raises(ValueError, match="state was saved with config"):
        other.load_state_dict(state)
    assert other.rounds_started == 0 and other._owed is None


def test_a_corrupted_message_raises_and_nothing_of_it_is_applied() -> None:
    sim = WaitFreeSimulator(2, NUMEL, graph=GRAPH, spec=SPEC)
    xs = _start(2)
    sim.run(xs, 3)
    sim.members[0].end_step(xs[0])   # in member 1's box now
    box = sim.boxes._queue(0, 1, "m")
    box[-1][1][5] ^= 0xFF
    received = sim.members[1].links[0].received
    with pytest.raises(CorruptPayloadError, match="checksum"):
        sim.members[1].prepare()
    assert sim.members[1].links[0].received == received


def test_threads_at_different_speeds_drain_and_close_cleanly() -> None:
    n = 4
    world = MemoryWorld(n, timeout_s=30)

    def body(rank: int) -> tuple[int, dict[int, int], dict[int, int], torch.Tensor]:
        g = OnePeerWaitFree(list(range(n)), world.group(list(range(n)), rank), NUMEL,
                            spec=SPEC, graph=GRAPH, timeout_s=20)
        x = torch.full((NUMEL,), float(rank))
        # rank 0 slow: a fifth of the rounds, each after a longer sleep (counts, not speeds:
        # a loaded machine schedules threads as it likes)
        for _ in range(8 if rank == 0 else 40):
            g.prepare()
            g.end_step(x)
            time.sleep(0.02 if rank == 0 else 0.002)
        g.drain()
        g.settle(x)
        out = (g.rounds_started, {p: lk.sent for p, lk in g.links.items()},
               {p: lk.received for p, lk in g.links.items()}, x.clone())
        g.close()
        return out

    res = world.run(body, timeout_s=30)
    assert [r[0] for r in res] == [8, 40, 40, 40]
    for rank, (_, _, received, _) in enumerate(res):
        assert received == {p: res[p][1][rank] for p in received}
    mean = torch.stack([r[3] for r in res]).double().mean(0)
    assert float((mean - (n - 1) / 2).abs().max()) < 1e-5


@pytest.mark.parametrize(("name", "value", "match"), [
    ("graph", "ring", r"graph must be one of \('one-peer-exp',\), got 'ring'"),
    ("on_peer_loss", "skip", "on_peer_loss must be one of"),
])
def test_bad_arguments_name_themselves(name: str, value: object, match: str) -> None:
    world = MemoryWorld(2)
    with pytest.raises(ValueError, match=match):
        OnePeerWaitFree([0, 1], world.group([0, 1], 0), NUMEL, spec=SPEC,
                        **{"graph": GRAPH, name: value})


def test_the_survivors_sum_floods_the_links_and_gives_every_live_member_the_same_bits() -> None:
    n, lost = 8, 5
    world = MemoryWorld(n, timeout_s=30)
    ranks = list(range(n))

    def body(rank: int) -> tuple[torch.Tensor, torch.Tensor, int, list[int]] | None:
        group = world.group(ranks, rank)
        g = OnePeerWaitFree(ranks, group, NUMEL, spec=SPEC, graph=GRAPH, timeout_s=5,
                            on_peer_loss="continue")
        x = _start(n)[rank].clone()
        for step in range(30):
            if rank == lost and step == 10:
                group.mailboxes.kill(lost)   # dies: its links break
                return None
            g.prepare()
            g.end_step(x)
            time.sleep(0.002)
        g.drain()
        g.settle(x)
        total, count = g.survivors_sum(x)
        out = (x.clone(), total, count, sorted(g.lost))
        g.close()
        return out

    res = world.run(body, timeout_s=60)
    live = [i for i in range(n) if i != lost]
    assert res[lost] is None
    xs = [res[i][0] for i in live]
    want = xs[0].clone()
    for x in xs[1:]:
        want.add_(x)   # in member order, as the sum runs
    for i in live:
        assert res[i][2] == n - 1
        assert torch.equal(res[i][1], want), i
        assert res[i][3] == [lost]   # every live member learnt the loss


def test_a_seat_taken_late_is_sat_out_until_it_joins_then_linked() -> None:
    # member 7 absent at the start (a seat the job may grow into): its peers sit out its
    # rounds; it joins from member 6's state and every peer links to it
    from qcomm.collectives.gossip.joining import admit, join_state, start_joined, start_without

    n = 8
    sim = WaitFreeSimulator(n, NUMEL, graph=GRAPH, spec=SPEC, delay=1, on_peer_loss="continue")
    sim.kill(7)
    for i in range(7):
        start_without(sim.members[i], {7})
    xs = _start(n)
    sim.run(xs, 12)
    assert all(7 not in sim.members[i].links for i in range(7))
    assert sim.members[3].rounds_started == 12 and sim.members[3].links[2].sent == 4
    sim.boxes.revive(7)
    sim.killed.discard(7)
    start_joined(sim.members[7], join_state(sim.members[6]))
    xs[7].copy_(xs[6])
    for i in range(7):
        admit(sim.members[i], 7)
    sim.run(xs, 40)
    xs = _settled(sim, xs)
    assert _links_exact(sim.members) == n * hops(n)
    assert all(sim.members[p].links[7].received > 0 for p in sim.members[7].peers)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), "5"])
def test_wait_linked_names_a_bad_timeout_and_says_when_links_are_made(timeout_s) -> None:
    """In memory every link exists from the start: made at once; a bad bound is named and
    opens nothing."""
    world = MemoryWorld(2)
    g = OnePeerWaitFree([0, 1], world.group([0, 1], 0), NUMEL, spec=SPEC, graph=GRAPH)
    with pytest.raises((ValueError, TypeError), match="timeout_s"):
        g.wait_linked(timeout_s)
    assert g._streams is None
    assert g.wait_linked(0.1)
    g.close()
