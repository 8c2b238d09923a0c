"""Wait-free gossip in one process: members at different speeds, messages that arrive late or
several at once, the backlog bound, consensus and the mean, faults, and resume.

The simulator (:class:`WaitFreeSimulator`) is deterministic: a member with period p takes one
step every p ticks, and a message from i to j becomes visible ``delay`` ticks after it was sent.
"""

from __future__ import annotations

import time

import pytest
import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerTimeoutError
from qcomm.collectives.gossip import WaitFreeGossip
from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
from qcomm.compress import QuantSpec

NUMEL = 1024
SPEC = QuantSpec(4, 128, "stochastic")


def _start(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


def _mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).mean(0)


def _hat_own(member: WaitFreeGossip) -> torch.Tensor:
    return member._hat_own


@pytest.mark.parametrize(("periods", "delay"), [([5, 1, 1, 1], 0), ([5, 1, 1, 1], 3),
                                                ([1, 2, 1, 3], 1)])
def test_a_slow_member_holds_nobody_back_and_every_message_is_applied_once_in_order(
        periods: list[int], delay: int) -> None:
    sim = WaitFreeSimulator(4, NUMEL, periods=periods, delay=delay, spec=SPEC, gamma=0.3)
    xs = _start(4)
    ticks = 150
    sim.run(xs, ticks)
    # Every member took its own number of steps: nobody waited for a slower neighbour.
    assert [m.steps for m in sim.members] == [ticks // p + (ticks % p > 0) for p in periods]
    assert sim.stalled_ticks == [0, 0, 0, 0]
    sim.drain()
    for m in sim.members:
        for k, p in enumerate(m.peers):
            other = sim.members[p]
            # Every message of p, once: the counts match, and the copy equals p's own copy
            # (the same payloads summed, some in batches: equal up to float32 rounding).
            assert m.received[k] == other.rounds_started
            torch.testing.assert_close(m._links.copies[k], _hat_own(other), rtol=0, atol=1e-5)


def test_messages_arriving_three_at_a_time_are_applied_as_one_batch() -> None:
    # Member 0 takes a step every 3 ticks: each of its rounds finds 3 new messages from each
    # neighbour, applied in one dequant_accumulate per fragment.
    sim = WaitFreeSimulator(3, NUMEL, graph="complete", periods=[3, 1, 1], spec=SPEC,
                            fragments=2)
    xs = _start(3)
    seen = []
    original = sim.members[0]._apply_pending

    def spy() -> None:
        seen.append([len(msgs) for msgs in sim.members[0]._links.pending])
        original()

    sim.members[0]._apply_pending = spy
    sim.run(xs, 30)
    assert seen[0] == [0, 0]          # tick 0: it steps first, nothing has come yet
    assert all(s == [3, 3] for s in seen[1:]), seen
    sim.drain()
    for k, p in enumerate(sim.members[0].peers):
        torch.testing.assert_close(sim.members[0]._links.copies[k], _hat_own(sim.members[p]),
                                   rtol=0, atol=1e-5)


def test_the_backlog_bound_holds_and_the_sender_stalls_only_at_it() -> None:
    cap = 3
    sim = WaitFreeSimulator(2, NUMEL, periods=[1, 6], spec=SPEC, max_backlog=cap)
    xs = _start(2)
    most = 0
    for _ in range(120):
        sim.tick(xs)
        most = max(most, sim.boxes.pending(0, 1))
    assert most == cap                       # reached, never passed
    assert sim.stalled_ticks[0] > 0          # member 0 waited at the bound ...
    assert sim.stalled_ticks[1] == 0
    # ... and still ran ahead: up to `cap` rounds per round of its neighbour.
    assert sim.members[0].steps > 2 * sim.members[1].steps


@pytest.mark.parametrize(("staleness", "delay"), [(1, 1), (2, 2), (1, 6)])
def test_at_one_pace_the_mean_is_preserved_whatever_the_delay(staleness: int,
                                                               delay: int) -> None:
    # Every term one member adds, its neighbour adds negated (its mirror): once the messages
    # are in and what is owed is added, the average has moved by float32 rounding only, with
    # messages late by several rounds too.
    sim = WaitFreeSimulator(4, NUMEL, delay=delay, spec=SPEC, staleness=staleness, gamma=0.2)
    xs = _start(4)
    before = _mean(xs)
    start = sim.consensus_distance(xs)
    sim.run(xs, 400)   # a late copy slows the agreement: 1e-4 takes about 300 ticks at 6
    sim.drain()
    for m, x in zip(sim.members, xs, strict=True):
        m.settle(x)
    assert float((_mean(xs) - before).norm()) < 1e-6 * float(before.norm())
    assert sim.consensus_distance(xs) < 1e-4 * start


@pytest.mark.parametrize(("delay", "lag"), [(1, 1), (2, 2), (3, 3)])
def test_the_lag_mixed_is_the_delay_and_every_term_pairs_at_one_pace(delay: int,
                                                                      lag: int) -> None:
    # A message visible `delay` ticks (rounds) after it was sent: from then on every round
    # mixes the fragment of the round `delay` before it (the earliest that every neighbour's
    # message of it has come), and pairs with both neighbours.
    sim = WaitFreeSimulator(4, NUMEL, delay=delay, spec=SPEC, fragments=4, gamma=0.2)
    xs = _start(4)
    sim.run(xs, 40)
    for m in sim.members:
        assert sum(m.mix_lags.values()) == 40 - 1          # every round from round 1 on
        assert m.mix_lags[lag] >= 40 - 1 - lag             # all but the first few
        assert set(m.mix_lags) <= set(range(1, lag + 1))
        assert m.terms["possible"] == 2 * (40 - 1) and m.terms["paired"] >= 2 * (40 - 1 - lag)


@pytest.mark.parametrize("periods", [[5, 1, 1, 1], [2, 1, 1, 1], [1, 3, 1, 2]])
def test_members_at_different_step_counts_reach_consensus(periods: list[int]) -> None:
    sim = WaitFreeSimulator(4, NUMEL, periods=periods, delay=1, spec=SPEC, gamma=0.3)
    xs = _start(4)
    start = sim.consensus_distance(xs)
    sim.run(xs, 300)
    sim.drain()
    assert sim.consensus_distance(xs) < 1e-4 * start


@pytest.mark.parametrize("periods", [[1, 20, 20, 20], [20, 1, 1, 1]])
def test_a_member_twenty_times_faster_or_slower_than_its_neighbours_converges(
        periods: list[int]) -> None:
    """A fast member pairs a term with a slow neighbour's copy only when that copy has changed
    (at most once per message of the slower one), so the slow one is owed about one mirror per
    round of its own, not twenty: twenty terms of gamma w / 2 = 0.05 would add up to a step of
    1.05, past the other end, and the pair's difference would grow (it did, to 32 and 9e4 times
    the start)."""
    sim = WaitFreeSimulator(4, NUMEL, periods=periods, delay=1, spec=SPEC, gamma=0.3)
    xs = _start(4)
    start = sim.consensus_distance(xs)
    sim.run(xs, 1200)   # 60 rounds of the slow members: measured 1.9e-7 and 4.7e-8
    sim.drain()
    assert sim.consensus_distance(xs) < 1e-4 * start


def _quadratic_update(centers: list[torch.Tensor], lr: float):
    def update(i: int, x: torch.Tensor, step: int) -> None:
        x.sub_(lr * (x - centers[i]))
    return update


@pytest.mark.parametrize("periods", [[1, 1, 1, 1], [2, 1, 1, 1], [5, 1, 1, 1], [1, 3, 1, 2]])
def test_training_counts_every_step_once(periods: list[int]) -> None:
    """Member i minimizes ||x - c_i||^2 / 2. The mixing moves no mass, so the average moves by
    the local steps alone: at one pace it ends at the global optimum mean(c) (up to float32
    rounding, measured 6.9e-7), and with a member at half, a fifth, or a mix of paces at the
    optimum of the data weighted by each member's steps (the way asynchronous SGD weighs them),
    0.24 to 0.42 away (relative) from mean(c): measured within 1.5e-2, 2.3e-2 and 3.2e-3 of it
    (6%, 6% and 1% of that distance; the members do not agree exactly, their optima differ).
    A node that never gossiped would stay at its own c_i, 1.65 away."""
    sim = WaitFreeSimulator(4, NUMEL, periods=periods, delay=1, spec=SPEC, gamma=0.3)
    centers = _start(4, seed=7)
    xs = [torch.zeros(NUMEL) for _ in range(4)]
    sim.run(xs, 600, _quadratic_update(centers, 0.05))
    sim.drain()
    for m, x in zip(sim.members, xs, strict=True):
        m.settle(x)
    optimum = _mean(centers)
    rates = torch.tensor([1 / p for p in periods], dtype=torch.float64)
    weighted = sum(r * c.double() for r, c in zip(rates, centers, strict=True)) / rates.sum()
    norm = float(optimum.norm())
    to_weighted = float((_mean(xs) - weighted).norm()) / norm
    step_bias = float((weighted - optimum).norm()) / norm
    if len(set(periods)) == 1:
        assert to_weighted < 1e-5, to_weighted
    else:
        assert step_bias > 0.2 and to_weighted < 0.1 * step_bias, (to_weighted, step_bias)


def _excess(xs: list[torch.Tensor], optimum: torch.Tensor) -> float:
    """Mean over the members of ``||x_i - optimum||^2 / 2``: each member's excess loss on the
    objective ``optimum`` minimizes (the members' quadratics averaged, optionally weighted)."""
    return float(torch.stack([((x.double() - optimum) ** 2).sum() / 2 for x in xs]).mean())


_LOCKSTEP_EXCESS: dict[int, float] = {}


def _lockstep_excess(centers: list[torch.Tensor], steps: int) -> float:
    """The same training under the bounded-staleness gossip (staleness 1, every message on
    time): what the wait-free runs are held to (the centres are always seed 7's: one run per
    step count)."""
    if steps in _LOCKSTEP_EXCESS:
        return _LOCKSTEP_EXCESS[steps]
    n = len(centers)
    clock = {"t": 0.0}
    world = MemoryWorld(n, clock=lambda: clock["t"])
    members = [CompressedGossip(list(range(n)), world.group(list(range(n)), i), NUMEL,
                                spec=SPEC, gamma=0.3, staleness=1) for i in range(n)]
    xs = [torch.zeros(NUMEL) for _ in range(n)]
    update = _quadratic_update(centers, 0.05)
    for t in range(steps):
        for i, m in enumerate(members):
            m.prepare()
            update(i, xs[i], t)
            m.end_step(xs[i])
        clock["t"] = t + 1.0
    _LOCKSTEP_EXCESS[steps] = _excess(xs, _mean(centers))
    return _LOCKSTEP_EXCESS[steps]


@pytest.mark.parametrize("steps", [80, 160])
@pytest.mark.parametrize(("periods", "delay"), [([1, 1, 1, 1], 6), ([1, 1, 1, 2], 1)])
def test_a_late_message_or_a_slow_member_costs_at_most_5_percent_at_equal_steps(
        periods: list[int], delay: int, steps: int) -> None:
    """Member i minimizes ||x - c_i||^2 / 2 (the centres differ, so the members never agree
    exactly and the mixing decides how close they get). When the fastest member has taken
    ``steps`` steps, the members' excess loss is within 5% of lockstep's at the same step:
    with every message six steps late on the global optimum (measured +3.5% and +1.5%), and
    with a member at half pace on the optimum of the data weighted by each member's steps
    (what its steps can reach; measured -2.4% and -4.0%)."""
    centers = _start(4, seed=7)
    sim = WaitFreeSimulator(4, NUMEL, periods=periods, delay=delay, spec=SPEC, gamma=0.3)
    xs = [torch.zeros(NUMEL) for _ in range(4)]
    update = _quadratic_update(centers, 0.05)
    while max(m.steps for m in sim.members) < steps:
        sim.tick(xs, update)
    rates = [1 / p for p in periods]
    optimum = sum(r * c.double() for r, c in zip(rates, centers, strict=True)) / sum(rates)
    assert _excess(xs, optimum) < 1.05 * _lockstep_excess(centers, steps)


def test_a_corrupted_message_raises_and_nothing_is_applied() -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    xs = _start(2)
    sim.run(xs, 3)
    m1 = sim.members[1]
    copies = m1._links.copies.clone()
    received = list(m1.received)
    # Flip one byte of member 0's next message, in the mailbox.
    sim.members[0].prepare()
    sim.members[0].end_step(xs[0])
    queue = sim.boxes._queue(0, 1)
    queue[-1][1][5] ^= 0xFF
    sim.now += 1
    with pytest.raises(CorruptPayloadError) as info:
        m1.prepare()
    assert info.value.peers == [0] and "checksum" in str(info.value)
    assert torch.equal(m1._links.copies, copies) and m1.received == received


def test_a_silent_neighbour_is_the_named_timeout_within_the_deadline() -> None:
    world = MemoryWorld(2, timeout_s=30)
    timeout_s = 0.5

    def body(rank: int) -> dict:
        g = WaitFreeGossip([0, 1], world.group([0, 1], rank), NUMEL, spec=SPEC,
                           timeout_s=timeout_s)
        x = torch.zeros(NUMEL)
        if rank == 1:
            g.prepare()
            g.end_step(x)   # one round, then silence (it never closes)
            time.sleep(3 * timeout_s)
            return {}
        t0 = time.monotonic()
        while True:
            try:
                g.prepare()
                g.end_step(x)
            except PeerTimeoutError as e:
                return {"peers": e.peers, "link": e.link, "after": time.monotonic() - t0}
            time.sleep(0.01)

    res = world.run(body, timeout_s=30)[0]
    assert res["peers"] == [1] and res["link"] == "inter"
    assert timeout_s <= res["after"] < timeout_s + 1.0


def test_threads_at_different_speeds_drain_and_close_cleanly() -> None:
    n = 3
    world = MemoryWorld(n, timeout_s=30)

    def body(rank: int) -> tuple[int, list[int], torch.Tensor]:
        g = WaitFreeGossip(list(range(n)), world.group(list(range(n)), rank), NUMEL,
                           spec=SPEC, graph="complete", timeout_s=20)
        x = torch.full((NUMEL,), float(rank))
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            g.prepare()
            g.end_step(x)
            time.sleep(0.03 if rank == 0 else 0.005)
        g.drain()
        out = (g.rounds_started, list(g.received), g._links.copies.clone())
        g.close()
        return out

    res = world.run(body, timeout_s=30)
    rounds = [r[0] for r in res]
    assert min(rounds[1:]) > 2 * rounds[0]   # the fast ones ran ahead
    for rank, (_, received, _) in enumerate(res):
        peers = [p for p in range(n) if p != rank]
        assert received == [rounds[p] for p in peers]


@pytest.mark.parametrize("gamma", [None, 0.8])
def test_state_after_a_drain_resumes_bit_exact(gamma: float | None) -> None:
    # at gamma 0.8 a copy serves one term until it changes: the terms counted per copy are
    # part of the state (a member 3 times faster than its neighbour is held by them)
    kwargs = dict(periods=[3, 1, 1, 2], delay=1, spec=SPEC, fragments=2, outer_momentum=0.5,
                  gamma=gamma)
    a = WaitFreeSimulator(4, NUMEL, **kwargs)
    xs = _start(4)
    a.run(xs, 40)
    a.drain()
    states = [m.state_dict() for m in a.members]
    saved = [x.clone() for x in xs]
    b = WaitFreeSimulator(4, NUMEL, **kwargs)
    b.now = a.now
    for m, st in zip(b.members, states, strict=True):
        m.load_state_dict(st)
    a.run(xs, 30)
    b.run(saved, 30)
    for x, y in zip(xs, saved, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bad", [[[-1, 0]], [[0]], [[0, 0], [0, 0], [0, 0]], "0", [[0.5, 0]]])
def test_saved_term_counts_that_are_not_counts_are_refused_and_change_nothing(bad) -> None:
    a = WaitFreeSimulator(2, NUMEL, spec=SPEC, fragments=2)
    a.run(_start(2), 10)
    a.drain()
    state = dict(a.members[0].state_dict(), terms_on_copy=bad)
    m = WaitFreeSimulator(2, NUMEL, spec=SPEC, fragments=2).members[0]
    before = (m.steps, m.rounds_started, list(m.peers), list(m.received), m._terms.termed)
    with pytest.raises(ValueError, match=r"state\['terms_on_copy'\] must be 1 lists of 2 ints"):
        m.load_state_dict(state)
    assert (m.steps, m.rounds_started, list(m.peers), list(m.received), m._terms.termed) == before


def test_state_without_a_drain_is_refused() -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    sim.run(_start(2), 3)
    with pytest.raises(RuntimeError, match="drain"):
        sim.members[0].state_dict()


@pytest.mark.parametrize(("name", "value", "match"), [
    ("max_backlog", 0, "max_backlog"), ("round_period", 0, "round_period"),
    ("staleness", -1, "staleness"), ("gamma", 1.5, "gamma"),
])
def test_bad_arguments_name_themselves(name: str, value: object, match: str) -> None:
    group = MemoryWorld(2, clock=lambda: 0.0).group([0, 1], 0)
    with pytest.raises(ValueError, match=match):
        WaitFreeGossip([0, 1], group, NUMEL, **{name: value})


@pytest.mark.parametrize(("x", "error", "match"), [
    (torch.zeros(NUMEL, dtype=torch.float64), TypeError, "float32"),
    (torch.zeros(NUMEL - 1), ValueError, "numel"),
    (torch.zeros(0), ValueError, "numel"),
    (torch.zeros(2, NUMEL)[:, 0], ValueError, "numel"),
    (torch.zeros(NUMEL * 2)[::2], ValueError, "contiguous"),
    ("not a tensor", TypeError, "torch.Tensor"),
])
def test_a_bad_x_is_refused_and_changes_nothing(x: object, error: type, match: str) -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    sim.run(_start(2), 2)
    m = sim.members[0]
    before = (m.steps, m.rounds_started, list(m.received), sim.boxes.pending(0, 1))
    with pytest.raises(error, match=match):
        m.end_step(x)
    assert (m.steps, m.rounds_started, list(m.received), sim.boxes.pending(0, 1)) == before


def test_a_nonfinite_x_is_refused_before_anything_is_sent() -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    xs = _start(2)
    sim.run(xs, 2)
    m = sim.members[0]
    own = m._hat_own.clone()
    before = (m.steps, m.rounds_started)
    xs[0][3] = float("nan")
    with pytest.raises(FloatingPointError):
        m.end_step(xs[0])
    assert sim.boxes.pending(0, 1) == 0 and torch.equal(m._hat_own, own)
    assert (m.steps, m.rounds_started) == before
