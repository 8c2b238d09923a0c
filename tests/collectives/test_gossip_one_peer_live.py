"""The one-peer schedule over the live members only (:func:`live_partner`), in the simulator:
after a loss the schedule runs over the survivors' positions, so 4 survivors of 6 average
exactly in 2 rounds without compression, and with the 4-bit codec the survivors' sum is kept
(rounds in flight with the lost member are dropped) while they reach consensus."""

from __future__ import annotations

import pytest
import torch

from qcomm.collectives.gossip.schedules import live_partner, one_peer_partner
from qcomm.collectives.memory import GossipSimulator
from qcomm.compress import QuantSpec

NUMEL = 256
EPS32 = 2.0**-24
SPEC4 = QuantSpec(4, 128, "stochastic")


def _xs(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


@pytest.mark.parametrize("live", [[0, 1, 2, 3], [0, 2, 3, 5, 7], [1, 4], [3], [0, 1, 5, 6, 9, 11]])
def test_live_partner_pairs_only_live_members_symmetrically(live: list[int]) -> None:
    for t in range(8):
        partners = {i: live_partner(i, t, live) for i in live}
        for i, p in partners.items():
            assert p is None or (p in live and p != i and partners[p] == i), (t, i, p)
    everyone = list(range(8))
    assert all(live_partner(i, t, everyone) == one_peer_partner(i, t, 8)
               for i in everyone for t in range(6))   # nobody lost: the schedule itself


def test_live_partner_refuses_a_bad_live_list() -> None:
    with pytest.raises(ValueError, match=r"node must be one of the live members \[0, 2\], "
                                         r"got 1"):
        live_partner(1, 0, [0, 2])
    with pytest.raises(ValueError, match=r"live must be distinct member numbers, ascending, "
                                         r"got \[2, 0\]"):
        live_partner(0, 0, [2, 0])


def test_four_survivors_of_six_average_exactly_in_two_rounds() -> None:
    n = 6
    xs = _xs(n, 64)
    sim = GossipSimulator(n, 64, graph="one-peer-exp", spec=None, staleness=0)
    sim.lose(1)   # before any round: the survivors start independent, at round 0
    sim.lose(4)
    live = [0, 2, 3, 5]
    mean = torch.stack([xs[i] for i in live]).double().mean(0)
    d0 = GossipSimulator.consensus_distance([xs[i] for i in live])
    sim.step(xs)   # one round short: only the pairs agree
    assert GossipSimulator.consensus_distance([xs[i] for i in live]) > 0.1 * d0
    sim.step(xs)
    for i in live:   # exact up to float32 rounding, as with 4 members from the start
        torch.testing.assert_close(xs[i].double(), mean, rtol=0, atol=4 * 2 * EPS32 * 4)


@pytest.mark.parametrize("tau", [0, 1])
def test_with_the_codec_the_survivors_keep_their_sum_and_reach_consensus(tau: int) -> None:
    n = 8
    xs = _xs(n)
    sim = GossipSimulator(n, NUMEL, graph="one-peer-exp", spec=SPEC4, staleness=tau, seed=2)
    for _ in range(5):   # rounds with member 3 in flight at its loss (staleness 1)
        sim.step(xs)
    sim.lose(3)
    live = [i for i in range(n) if i != 3]
    total = torch.stack([xs[i] for i in live]).double().sum(0)
    scale = max(float(xs[i].abs().max()) for i in live)
    d0 = GossipSimulator.consensus_distance([xs[i] for i in live])
    rounds = 150
    for _ in range(rounds):
        sim.step(xs)
    drift = float((torch.stack([xs[i] for i in live]).double().sum(0) - total).abs().max())
    assert drift <= 2 * len(live) * rounds * EPS32 * scale
    assert GossipSimulator.consensus_distance([xs[i] for i in live]) <= 1e-3 * d0
    assert not sim.board or all(t >= sim.steps - 1 - tau for t, _ in sim.board)


def test_lose_needs_the_one_peer_graph() -> None:
    with pytest.raises(ValueError, match="lose\\(\\) needs graph='one-peer-exp'"):
        GossipSimulator(4, NUMEL, graph="ring").lose(1)
