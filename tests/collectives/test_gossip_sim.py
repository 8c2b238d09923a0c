"""CompressedGossip in the in-process simulator: convergence matrix, invariants, inputs, resume.

The simulator runs the same CompressedGossip code as over Gloo on a stepped in-memory world;
tests/collectives/test_gossip.py checks that both give the same bits.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from qcomm.collectives.gossip import CompressedGossip, default_gamma
from qcomm.collectives.gossip.graphs import neighbours
from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.memory import GossipSimulator, MemoryWorld
from qcomm.collectives.memory.transport import MemoryTransport
from qcomm.compress import QuantSpec, packed_nbytes

NUMEL = 512
EPS32 = 2.0**-24  # unit roundoff of float32

# With zero updates and the DEFAULT gamma, the consensus distance falls geometrically to
# <= 1e-3 of its start within ROUND_BOUND[bits][staleness] rounds, for bits 8/4/2/1 (error
# feedback is built into CHOCO: q = Q(x - x_hat)), staleness 0/1/2, ring (4 nodes) and
# exponential (6 nodes) graphs. Bounds: the measured rounds (docs/gossip_tuning.md: at most
# 32 / 35 / 574 rounds for 8-4 / 2 / 1 bits on the ring of 4) with margin for other seeds and
# sizes.
ROUND_BOUND = {8: (120, 120, 120), 4: (120, 120, 120), 2: (120, 120, 120),
               1: (800, 800, 800)}
GRAPH_CASES = [("ring", 4), ("exponential", 6)]


def _xs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


@pytest.mark.parametrize(("graph", "n"), GRAPH_CASES)
@pytest.mark.parametrize("tau", [0, 1, 2])
@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_zero_update_consensus_and_average(bits: int, tau: int, graph: str, n: int) -> None:
    spec = QuantSpec(bits, 128, "stochastic")
    xs = _xs(n)
    mean0 = torch.stack(xs).to(torch.float64).mean(0)
    scale = max(float(x.abs().max()) for x in xs)
    sim = GossipSimulator(n, NUMEL, graph=graph, spec=spec, staleness=tau)
    bound = ROUND_BOUND[bits][tau]
    rho = 1e-3 ** (1 / bound)  # the geometric rate that reaches 1e-3 at the bound
    d0 = sim.consensus_distance(xs)
    for k in range(1, bound + 1):
        sim.step(xs)
        d = sim.consensus_distance(xs)
        # Geometric fall: never above a constant times the envelope d0 * rho^k.
        assert d <= 10 * d0 * rho**k, (k, d / d0)
        if d <= 1e-3 * d0:
            break
    assert d <= 1e-3 * d0, f"{d / d0:.2e} of the start after {bound} rounds"
    # The average is preserved up to float32 rounding: each round adds a few roundings of size
    # EPS32 * |x| to every element of every member's update (the mixing add, the accumulator).
    drift = float((torch.stack(xs).to(torch.float64).mean(0) - mean0).abs().max())
    assert drift <= 4 * k * EPS32 * scale, (drift, k)


@pytest.mark.parametrize(("graph", "n"), [("ring", 2), ("ring", 5), ("exponential", 8),
                                          ("complete", 4)])
def test_bytes_per_round_from_stats(graph: str, n: int) -> None:
    spec = QuantSpec(2, 64, "nearest")
    sim = GossipSimulator(n, 300, graph=graph, spec=spec, staleness=1)
    xs = [torch.randn(300) for _ in range(n)]
    for t in range(1, 4):
        sim.step(xs)
        for i, st in enumerate(sim.stats):
            deg = len(neighbours(graph, i, n))
            snap = st.snapshot()
            assert snap["bytes_sent"]["inter"] == t * (packed_nbytes(300, spec) + SEAL_NBYTES) * deg
            assert snap["messages_sent"]["inter"] == t * deg
            assert snap["bytes_sent"]["intra"] == 0


def test_single_member_is_a_noop() -> None:
    sim = GossipSimulator(1, NUMEL, staleness=0)
    x = torch.randn(NUMEL)
    before = x.clone()
    for _ in range(3):
        sim.step([x])
    assert torch.equal(x, before)
    assert sim.stats[0].snapshot()["bytes_sent"]["inter"] == 0
    assert sim.members[0].rounds_started == 3


def test_own_public_copy_is_the_decoded_payload() -> None:
    # Every member's public copy of member i must equal what the neighbours decode: with
    # staleness 0 and one round, hat_pub_i == D(q_i) and mix_acc_i == sum_j w_ij D(q_j).
    from qcomm.compress import Packed, dequantize

    sim = GossipSimulator(3, NUMEL, spec=QuantSpec(4, 128, "nearest"), staleness=0, gamma=0.5)
    xs = _xs(3)
    payloads = []
    orig_exchange = MemoryTransport.exchange

    def spy(self, round, payload, recv):
        payloads.append(payload.clone())
        return orig_exchange(self, round, payload, recv)

    MemoryTransport.exchange = spy
    try:
        sim.step(xs)
    finally:
        MemoryTransport.exchange = orig_exchange
    # A message is the payload followed by its seal.
    dec = [dequantize(Packed.from_payload(p[:-SEAL_NBYTES], NUMEL, QuantSpec(4, 128, "nearest")))
           for p in payloads]
    for i, m in enumerate(sim.members):
        assert torch.equal(m._hat_pub, dec[i])
        assert torch.equal(m._hat_own, dec[i])
        want = sum(dec[j] for j in range(3)) / 3  # ring of 3: uniform 1/3 weights
        torch.testing.assert_close(m._mix_acc, want, rtol=0, atol=4 * EPS32 * 4)


@pytest.mark.parametrize("tau", [0, 2])
def test_state_dict_resume_is_bit_identical(tau: int) -> None:
    kw = dict(graph="ring", spec=QuantSpec(4, 128, "stochastic"), staleness=tau, seed=3)
    ref = _xs(4)
    whole = GossipSimulator(4, NUMEL, **kw)
    for _ in range(12):
        whole.step(ref)
    xs = _xs(4)
    first = GossipSimulator(4, NUMEL, **kw)
    for _ in range(5):
        first.step(xs)
    buf = io.BytesIO()
    torch.save([m.state_dict() for m in first.members], buf)  # a real checkpoint round trip
    buf.seek(0)
    states = torch.load(buf, weights_only=True)
    assert [len(s["in_flight"]) for s in states] == [tau] * 4
    second = GossipSimulator(4, NUMEL, **kw)
    for m, s in zip(second.members, states, strict=True):
        m.load_state_dict(s)
    for _ in range(7):
        second.step(xs)
    for a, b in zip(xs, ref, strict=True):
        assert torch.equal(a, b)


def test_flush_applies_everything_and_keeps_antisymmetry() -> None:
    sim = GossipSimulator(4, NUMEL, staleness=2, gamma=0.2)
    xs = _xs(4)
    for _ in range(6):
        sim.step(xs)
    for m in sim.members:
        m.flush()
        assert m.rounds_applied == m.rounds_started == 6
    total = sum((m._mix_acc - m._hat_pub).double() for m in sim.members)
    assert float(total.abs().max()) <= 1e-5
    sim.step(xs)  # continues: round 6 - 2 = 4 was applied by flush, nothing applied twice
    assert all(m.rounds_applied == 6 for m in sim.members)


def _member(**kw) -> CompressedGossip:
    """Member 0 of three on a stepped in-memory world (nothing is sent at construction)."""
    world = MemoryWorld(3, clock=lambda: 0.0)
    return CompressedGossip([0, 1, 2], world.group([0, 1, 2], 0), NUMEL, **kw)


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"gamma": 0.0}, ValueError, "gamma"), ({"gamma": 1.5}, ValueError, "gamma"),
    ({"gamma": -0.1}, ValueError, "gamma"), ({"gamma": True}, TypeError, "gamma"),
    ({"gamma": math.nan}, ValueError, "gamma"), ({"gamma": "0.1"}, TypeError, "gamma"),
    ({"staleness": -1}, ValueError, "staleness"), ({"staleness": 1.0}, TypeError, "staleness"),
    ({"staleness": True}, TypeError, "staleness"), ({"graph": "star"}, ValueError, "graph"),
    ({"mixing": "max"}, ValueError, "mixing"), ({"timeout_s": 0}, ValueError, "timeout_s"),
    ({"timeout_s": math.inf}, ValueError, "timeout_s"), ({"seed": -1}, ValueError, "seed"),
    ({"spec": 4}, TypeError, "spec"),
])
def test_bad_arguments(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        _member(**kw)


def test_bad_numel_and_x() -> None:
    world = MemoryWorld(3, clock=lambda: 0.0)
    with pytest.raises(ValueError, match="numel"):
        CompressedGossip([0, 1], world.group([0, 1], 0), 0)
    # group_ranks that are not the group's members, in order
    with pytest.raises(ValueError, match=r"global ranks of the group in group order, \[0, 1, 2\]"):
        CompressedGossip([0, 2, 1], world.group([0, 1, 2], 0), NUMEL)
    g = _member(gamma=0.5, staleness=1)
    with pytest.raises(TypeError, match="float32"):
        g.step(torch.zeros(NUMEL, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        g.step([0.0] * NUMEL)
    with pytest.raises(ValueError, match=f"numel {NUMEL}"):
        g.step(torch.zeros(NUMEL + 1))
    with pytest.raises(ValueError, match="contiguous"):
        g.step(torch.zeros(NUMEL, 2)[:, 0])
    g.step(torch.zeros(NUMEL))  # buffers now live on the CPU
    with pytest.raises(ValueError, match="must be on cpu"):
        g.step(torch.zeros(NUMEL, device="meta"))
    with pytest.raises(ValueError, match="config"):
        _member(staleness=2).load_state_dict(_member(staleness=1).state_dict())
    g.close()
    with pytest.raises(RuntimeError, match="closed"):
        g.step(torch.zeros(NUMEL))


def test_default_gamma_table() -> None:
    for bits in (1, 2, 4, 8):
        gs = [default_gamma(bits, tau) for tau in range(6)]
        assert all(0 < g <= 1 for g in gs)
        assert gs == sorted(gs, reverse=True), "more staleness, smaller step"
    with pytest.raises(ValueError, match="bits"):
        default_gamma(3, 0)
    assert _member(staleness=2).gamma == default_gamma(4, 2)


def test_a_state_of_another_wire_format_is_refused_and_nothing_loaded() -> None:
    """Payloads carry no header: rounds in flight of another format would decode wrongly."""
    spec = QuantSpec(4, 128, "stochastic")
    sim = GossipSimulator(2, NUMEL, spec=spec, staleness=1)
    xs = _xs(2)
    for _ in range(3):
        sim.step(xs)
    state = sim.members[0].state_dict()
    assert state["wire_format"] == 2 and state["in_flight"]
    fresh = GossipSimulator(2, NUMEL, spec=spec, staleness=1).members[0]
    with pytest.raises(ValueError, match="wire format 1; this version decodes format 2"):
        fresh.load_state_dict({**state, "wire_format": 1})
    assert fresh.rounds_started == 0
    fresh.load_state_dict(state)
    assert fresh.rounds_started == 3


@pytest.mark.parametrize(("graph", "n"), [("ring", 4), ("ring", 5), ("complete", 4)])
@pytest.mark.parametrize(("staleness", "fragments_too_few", "fragments_enough"),
                         [(1, 1, 2), (2, 2, 4)])
def test_full_consensus_step_needs_more_fragments_than_staleness(
        graph: str, n: int, staleness: int, fragments_too_few: int,
        fragments_enough: int) -> None:
    # gamma = 1 mixes a fragment all the way to its neighbours' mean. When the fragment is
    # sent again before that correction is applied (staleness >= fragments), the delayed step
    # overshoots: the disagreement never falls (complete graph: it oscillates) or grows (ring).
    # With one more fragment than rounds in flight each correction lands first and the same
    # gamma converges fast. CommOptions warns about the first case.
    spec = QuantSpec(8, 128, "nearest")

    def distance_after(fragments: int, rounds: int) -> float:
        xs = _xs(n, seed=3)
        sim = GossipSimulator(n, NUMEL, graph=graph, spec=spec, staleness=staleness,
                              gamma=1.0, fragments=fragments)
        d0 = sim.consensus_distance(xs)
        for _ in range(rounds):
            sim.step(xs)
        return sim.consensus_distance(xs) / d0

    assert distance_after(fragments_too_few, 60) > 0.1
    assert distance_after(fragments_enough, 60) < 1e-3
