"""CHOCO gossip on the one-peer exponential graph in the in-memory GossipSimulator: exact
averaging without compression, per-link public copies, the average kept with the 4-bit codec,
bytes, and the refusal of the graph by the members that cannot take it yet."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip import CompressedGossip, WaitFreeGossip
from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.gossip.schedules import hops, one_peer_partner
from qcomm.collectives.memory import GossipSimulator, MemoryWorld, WaitFreeSimulator
from qcomm.collectives.memory.one_peer import ONE_PEER_GAMMA
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.engine import CommOptions

NUMEL = 256
EPS32 = 2.0**-24  # unit roundoff of float32
SPEC4 = QuantSpec(4, 128, "stochastic")


def _xs(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _mean64(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).to(torch.float64).mean(0)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_uncompressed_reaches_the_exact_average_in_log2_n_rounds(n: int) -> None:
    xs = _xs(n, 64)
    mean0 = _mean64(xs)
    sim = GossipSimulator(n, 64, graph="one-peer-exp", spec=None, staleness=0)
    assert sim.members[0].gamma == 1.0
    d0 = sim.consensus_distance(xs)
    for _ in range(hops(n) - 1):
        sim.step(xs)
    if n > 2:  # one round short: only halves of the group agree
        assert sim.consensus_distance(xs) > 0.1 * d0
    sim.step(xs)
    # Exact up to float32 rounding: each round rounds every element once or twice.
    assert sim.consensus_distance(xs) <= 4 * hops(n) * EPS32 * 4
    for x in xs:
        torch.testing.assert_close(x.double(), mean0, rtol=0, atol=4 * hops(n) * EPS32 * 4)


def test_link_copies_are_the_same_bits_at_both_ends() -> None:
    n, rounds = 8, 7
    sim = GossipSimulator(n, NUMEL, graph="one-peer-exp", spec=SPEC4, staleness=1, seed=5)
    xs = _xs(n)
    for _ in range(rounds):
        sim.step(xs)
    for m in sim.members:
        assert m.public_copies() == 3 * hops(n)  # memory: 3 copies per peer ever used
        for p in m.peers:
            other = sim.members[p]
            assert torch.equal(m.mine[p], other.theirs[m.member])
            assert torch.equal(m.theirs[p], other.mine[m.member])
    # With staleness 1 < K, a link's fresh copy was applied before it was next used, except
    # the link of the last round (still in flight).
    last = [one_peer_partner(i, rounds - 1, n) for i in range(n)]
    for m in sim.members:
        for p in m.peers:
            same = torch.equal(m.fresh[p], m.mine[p])
            assert same == (p != last[m.member]), (m.member, p)
    assert sim.board.keys() == {(rounds - 1, i) for i in range(n)}  # one round in flight


@pytest.mark.parametrize(("n", "tau", "bound"), [(16, 0, 40), (16, 1, 70), (12, 1, 90),
                                                 (64, 0, 45)])
def test_4bit_keeps_the_average_and_reaches_1e3(n: int, tau: int, bound: int) -> None:
    xs = _xs(n)
    mean0 = _mean64(xs)
    scale = max(float(x.abs().max()) for x in xs)
    sim = GossipSimulator(n, NUMEL, graph="one-peer-exp", spec=SPEC4, staleness=tau)
    assert sim.members[0].gamma == ONE_PEER_GAMMA[tau]
    d0 = sim.consensus_distance(xs)
    rounds = 0
    while rounds < bound:
        sim.step(xs)
        rounds += 1
        if sim.consensus_distance(xs) <= 1e-3 * d0:
            break
    d = sim.consensus_distance(xs)
    assert d <= 1e-3 * d0, f"{d / d0:.2e} of the start after {bound} rounds"
    # Paired mixing: what one end adds the other subtracts, so the average moves only by the
    # rounding of the additions to x (one per element per round).
    drift = float((_mean64(xs) - mean0).abs().max())
    assert drift <= 2 * rounds * EPS32 * scale, (drift, rounds)


def test_codec_without_paired_copies_would_drift() -> None:
    # The average really rests on the two ends mixing with the same copies: perturb one end's
    # copy of a link and the members' average moves by gamma / 2 times that perturbation.
    n = 4
    sim = GossipSimulator(n, NUMEL, graph="one-peer-exp", spec=SPEC4, staleness=0)
    xs = _xs(n)
    sim.step(xs)
    mean0 = _mean64(xs)
    p = one_peer_partner(0, 1, n)
    sim.members[0].theirs[p] += 1.0  # corrupted; both ends' copies should be equal
    sim.step(xs)
    drift = float((_mean64(xs) - mean0).abs().mean())
    assert drift == pytest.approx(sim.members[0].gamma / 2 / n, rel=1e-3)


@pytest.mark.parametrize("n", [6, 8])
def test_bytes_one_message_per_round_with_a_partner(n: int) -> None:
    sim = GossipSimulator(n, 300, graph="one-peer-exp", spec=QuantSpec(2, 64, "nearest"))
    xs = _xs(n, 300)
    rounds = 2 * hops(n) + 1
    for _ in range(rounds):
        sim.step(xs)
    per_message = packed_nbytes(300, QuantSpec(2, 64, "nearest")) + SEAL_NBYTES
    sents = [sum(one_peer_partner(i, t, n) is not None for t in range(rounds))
             for i in range(n)]
    assert (min(sents) < rounds) == (n == 6), "only n = 6 has members that sit rounds out"
    for sent, st in zip(sents, sim.stats, strict=True):
        snap = st.snapshot()
        assert snap["messages_sent"]["inter"] == sent
        assert snap["bytes_sent"]["inter"] == sent * per_message
        assert snap["bytes_sent"]["intra"] == 0


def test_a_lone_member_changes_nothing() -> None:
    sim = GossipSimulator(1, NUMEL, graph="one-peer-exp", staleness=0)
    x = torch.randn(NUMEL)
    before = x.clone()
    for _ in range(3):
        sim.step([x])
    assert torch.equal(x, before) and sim.stats[0].snapshot()["bytes_sent"]["inter"] == 0


def test_bad_x_and_settings() -> None:
    sim = GossipSimulator(2, NUMEL, graph="one-peer-exp")
    with pytest.raises(TypeError, match="float32"):
        sim.step([torch.zeros(NUMEL, dtype=torch.float64)] * 2)
    with pytest.raises(ValueError, match=f"numel {NUMEL}"):
        sim.step([torch.zeros(NUMEL + 1)] * 2)
    with pytest.raises(ValueError, match="gamma"):
        GossipSimulator(2, NUMEL, graph="one-peer-exp", gamma=1.5)
    with pytest.raises(ValueError, match="staleness"):
        GossipSimulator(2, NUMEL, graph="one-peer-exp", staleness=-1)
    with pytest.raises(TypeError, match="fragments"):  # not supported on this graph
        GossipSimulator(2, NUMEL, graph="one-peer-exp", fragments=2)


GRAPH_REFUSED = r"graph must be one of \('ring', 'exponential', 'complete'\) here, got " \
                r"'one-peer-exp'"


def test_the_static_members_refuse_the_graph_and_both_modes_take_it() -> None:
    world = MemoryWorld(4, clock=lambda: 0.0)
    group = world.group([0, 1, 2, 3], 0)
    # The lockstep OnePeerGossip takes it (test_gossip_one_peer_choco.py), and wait-free
    # OnePeerWaitFree (test_gossip_one_peer_wait_free.py); the static members do not.
    with pytest.raises(ValueError, match=GRAPH_REFUSED):
        CompressedGossip([0, 1, 2, 3], group, NUMEL, graph="one-peer-exp")
    with pytest.raises(ValueError, match=GRAPH_REFUSED):
        WaitFreeGossip([0, 1, 2, 3], group, NUMEL, graph="one-peer-exp")
    sim = WaitFreeSimulator(4, NUMEL, graph="one-peer-exp")
    assert all(type(m) is OnePeerWaitFree for m in sim.members)
    assert CommOptions(graph="one-peer-exp", wait_free=True).graph == "one-peer-exp"
    with pytest.raises(ValueError, match="graph must be one of"):
        GossipSimulator(4, NUMEL, graph="one-peer")
