"""The lockstep gossip on graph="one-peer-exp" (OnePeerGossip, which the factory picks) over the
in-memory world: the same bits as the simulator's reference members, one message per round,
fragments, its checkpoint (resumed, the same bits as never stopping), and what it does not take
yet."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip import CompressedGossip, WaitFreeGossip
from qcomm.collectives.gossip.config import GossipConfig
from qcomm.collectives.gossip.factory import build_gossip
from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.gossip.one_peer_choco import OnePeerGossip
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.gossip.schedules import hops, one_peer_partner
from qcomm.collectives.memory import GossipSimulator, MemoryWorld
from qcomm.compress import QuantSpec, packed_nbytes

NUMEL = 256
SPEC4 = QuantSpec(4, 128, "stochastic")
EPS32 = 2.0**-24


def _xs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


def _members(n: int, **kw) -> list[OnePeerGossip]:
    world = MemoryWorld(n, clock=lambda: 0.0)
    ranks = list(range(n))
    seed = kw.pop("seed", 0)
    config = GossipConfig.of(GossipConfig(graph="one-peer-exp"), kw)
    return [build_gossip(config, ranks, world.group(ranks, i), NUMEL, seed=seed)
            for i in range(n)]


def _round(members: list[CompressedGossip], xs: list[torch.Tensor]) -> None:
    for m, x in zip(members, xs, strict=True):  # every begin first: staleness 0 needs it
        m.begin(x)
    for m, x in zip(members, xs, strict=True):
        m.finish(x)


@pytest.mark.parametrize(("n", "tau"), [(8, 0), (8, 1), (6, 1), (5, 2)])
def test_same_bits_as_the_simulator_reference(n: int, tau: int) -> None:
    members = _members(n, spec=SPEC4, staleness=tau, seed=3)
    assert all(type(m) is OnePeerGossip for m in members)
    sim = GossipSimulator(n, NUMEL, graph="one-peer-exp", spec=SPEC4, staleness=tau, seed=3)
    assert members[0].gamma == sim.members[0].gamma
    xs, ref = _xs(n), _xs(n)
    d0 = sim.consensus_distance(xs)
    for _ in range(4 * hops(n)):
        _round(members, xs)
        sim.step(ref)
    for a, b in zip(xs, ref, strict=True):
        assert torch.equal(a, b)
    assert sim.consensus_distance(xs) < 0.5 * d0  # and it did mix
    for m, st in zip(members, sim.stats, strict=True):
        assert m.stats.snapshot() == st.snapshot()  # one sealed message per round with a peer


def test_one_message_per_round_and_copies_per_link() -> None:
    n = 8
    members = _members(n, spec=SPEC4, staleness=1)
    xs = _xs(n)
    for _ in range(5):
        _round(members, xs)
    per_message = packed_nbytes(NUMEL, SPEC4) + SEAL_NBYTES
    for m in members:
        snap = m.stats.snapshot()
        assert snap["messages_sent"]["inter"] == 5
        assert snap["bytes_sent"]["inter"] == 5 * per_message
        assert sorted(m.fresh) == sorted(m.mine) == sorted(m.theirs) == m.peers
        assert len(m.peers) == hops(n)
        for p in m.peers:
            assert torch.equal(m.mine[p], members[p].theirs[m.member])


@pytest.mark.parametrize(("n", "fragments", "rounds"), [(8, 2, 160), (16, 4, 320),
                                                      (12, 2, 200), (32, 8, 640)])
def test_fragments_converge_and_keep_the_average(n: int, fragments: int, rounds: int) -> None:
    # (16, 4): as many fragments as hops; a fragment taking the hop of the round's number
    # would meet one peer only, and the group would never agree
    members = _members(n, spec=SPEC4, staleness=1, fragments=fragments)
    xs = _xs(n)
    mean0 = torch.stack(xs).double().mean(0)
    scale = max(float(x.abs().max()) for x in xs)
    d0 = GossipSimulator.consensus_distance(xs)
    for _ in range(rounds):
        _round(members, xs)
    assert GossipSimulator.consensus_distance(xs) <= 1e-3 * d0
    drift = float((torch.stack(xs).double().mean(0) - mean0).abs().max())
    assert drift <= 2 * rounds * EPS32 * scale


def test_flush_and_a_member_that_sits_out() -> None:
    n = 3  # node 2 has no partner in round 0 (2 XOR 1 = 3)
    members = _members(n, spec=SPEC4, staleness=1)
    xs = _xs(n)
    before = xs[2].clone()
    _round(members, xs)
    _round(members, xs)  # applies round 0: node 2 sat it out, its x is unchanged
    assert one_peer_partner(2, 0, n) is None and torch.equal(xs[2], before)
    assert members[2].stats.snapshot()["messages_sent"]["inter"] == 1  # round 1 only
    for m in members:
        m.flush()
        assert m.rounds_applied == m.rounds_started == 2


def test_factory_and_what_the_static_members_refuse() -> None:
    world = MemoryWorld(4, clock=lambda: 0.0)
    group = world.group([0, 1, 2, 3], 0)
    m = build_gossip(GossipConfig(graph="one-peer-exp"), [0, 1, 2, 3], group, NUMEL)
    assert isinstance(m, OnePeerGossip) and m.peers == [1, 2]
    w = build_gossip(GossipConfig(graph="one-peer-exp", wait_free=True), [0, 1, 2, 3], group,
                     NUMEL)
    assert type(w) is OnePeerWaitFree and w.peers == [1, 2]
    with pytest.raises(ValueError, match=r"graph must be one of \('one-peer-exp',\)"):
        OnePeerGossip([0, 1, 2, 3], group, NUMEL, graph="ring")
    # the static members name the ones that take it, rather than mixing as if it were static
    with pytest.raises(ValueError, match=r"OnePeerGossip \(lockstep\) and OnePeerWaitFree"):
        CompressedGossip([0, 1, 2, 3], group, NUMEL, graph="one-peer-exp")
    with pytest.raises(ValueError, match=r"OnePeerGossip \(lockstep\) and OnePeerWaitFree"):
        WaitFreeGossip([0, 1, 2, 3], group, NUMEL, graph="one-peer-exp")


@pytest.mark.parametrize(("n", "tau", "outer"), [(8, 1, False), (6, 2, False), (8, 1, True)])
def test_a_checkpoint_resumes_with_the_bits_of_a_run_never_stopped(n: int, tau: int,
                                                                    outer: bool) -> None:
    kw = dict(spec=SPEC4, staleness=tau, seed=7)
    if outer:
        kw.update(outer_momentum=0.9, outer_lr=0.5)
    whole, stopped = _members(n, **kw), _members(n, **kw)
    xs, ys = _xs(n), _xs(n)
    for _ in range(5):   # rounds in flight at the save (staleness >= 1), sat-out rounds too
        _round(whole, xs)
        _round(stopped, ys)
    saved = [m.state_dict() for m in stopped]
    assert any(len(s["in_flight"]) for s in saved) and all(s["links"] for s in saved)
    resumed = _members(n, **kw)   # a new world: new links, nothing shared with the old one
    for m, s in zip(resumed, saved, strict=True):
        m.load_state_dict(s)
    for _ in range(7):
        _round(whole, xs)
        _round(resumed, ys)
    for a, b in zip(xs, ys, strict=True):
        assert torch.equal(a, b)


def test_a_state_of_other_links_is_refused_and_nothing_loaded() -> None:
    members = _members(8, spec=SPEC4, staleness=1, seed=1)
    xs = _xs(8)
    for _ in range(3):
        _round(members, xs)
    state = members[0].state_dict()
    other = _members(8, spec=SPEC4, staleness=1, seed=1)[3]
    before = other.state_dict()
    with pytest.raises(ValueError, match="state was saved with config"):
        other.load_state_dict(state)   # another member's
    assert other.state_dict() == before   # nothing loaded (no round yet: no links)
    fresh = _members(8, spec=SPEC4, staleness=1, seed=1)[0]
    short = dict(state, links={p: v for p, v in state["links"].items() if p != 4})
    with pytest.raises(ValueError, match=r"state\['links'\] must hold this member's peers "
                                         r"\[1, 2, 4\]"):
        fresh.load_state_dict(short)
    bad = dict(state, links={p: dict(v, mine=v["mine"][:-1]) for p, v in state["links"].items()})
    with pytest.raises(ValueError, match="mine/1"):
        fresh.load_state_dict(bad)
    assert fresh.state_dict()["links"] == {} and fresh.rounds_started == 0
