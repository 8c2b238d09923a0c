"""The outer step's anneal over a run of known length (qcomm/collectives/gossip/outer_anneal.py):
held early, a cosine to amplification 1 late, wired into both gossip modes, refused by name when
the length is no length, and, in the simulator, the compressed gossip whose inner step shrinks
to zero reaches consensus down to the codec's floor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.gossip.outer_anneal import HOLD, annealed_outer_lr
from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
from qcomm.compress import QuantSpec
from qcomm.engine import CommOptions

SLOW = dict(spec=QuantSpec(2, 128, "nearest"), gamma=0.8, staleness=1, fragments=4,
            round_period=4, outer_momentum=0.9, outer_lr=0.5)


def test_held_for_the_first_30_percent_then_a_cosine_to_amplification_one() -> None:
    lrs = [annealed_outer_lr(0.5, 0.9, s, 1000) for s in range(1200)]
    assert set(lrs[:int(HOLD * 1000) + 1]) == {0.5}
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert lrs[650] == pytest.approx(0.1 + 0.4 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    # at the end lr / (1 - mu) = 1: the progress as the inner optimizer made it
    assert lrs[1000] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)


@pytest.mark.parametrize(("lr", "mu"), [(1.0, 0.0), (0.05, 0.0), (0.3, 0.5)])
def test_an_outer_step_that_does_not_amplify_is_left_alone(lr: float, mu: float) -> None:
    # amplification lr / (1 - mu) <= 1 already: nothing to anneal
    assert {annealed_outer_lr(lr, mu, s, 100) for s in range(0, 200, 7)} == {lr}


def test_without_a_length_the_outer_lr_is_constant() -> None:
    assert {annealed_outer_lr(0.5, 0.9, s, None) for s in (0, 10**6)} == {0.5}


@pytest.mark.parametrize(("value", "error", "words"), [
    (0, ValueError, "total_steps must be an int >= 1, got 0"),
    (-5, ValueError, "total_steps must be an int >= 1, got -5"),
    (2.5, TypeError, "total_steps must be an int"), ("100", TypeError, "total_steps")])
def test_a_length_that_is_no_length_is_refused_by_name(value, error, words) -> None:
    with pytest.raises(error, match=words):
        CommOptions(total_steps=value)
    world = MemoryWorld(2)
    with pytest.raises(error, match=words):
        CompressedGossip([0, 1], world.group([0, 1], 0), 512, total_steps=value, **SLOW)


def _lockstep(n: int, numel: int, total: int | None) -> tuple[list[CompressedGossip], dict]:
    clock = {"t": 0}
    world = MemoryWorld(n, clock=lambda: float(clock["t"]))
    ranks = list(range(n))
    return [CompressedGossip(ranks, world.group(ranks, i), numel, total_steps=total, **SLOW)
            for i in range(n)], clock


def _train(members, clock, xs, targets, steps: int, lr_at) -> list[float]:
    """Each member steps toward its own target (its own optimum) with the step ``lr_at(t)``,
    then ends the step with its gossip; the consensus distance after each step."""
    out = []
    for t in range(steps):
        for m, x, c in zip(members, xs, targets, strict=True):
            m.prepare()
            x.sub_(lr_at(t) * (x - c))
            m.end_step(x)
        clock["t"] += 1
        s = torch.stack(xs)
        out.append(float(((s - s.mean(0)) ** 2).sum(1).mean()))
    return out


def _start(n: int, numel: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [torch.zeros(numel) for _ in range(n)], [torch.randn(numel, generator=g)
                                                    for _ in range(n)]


def test_the_lockstep_gossip_takes_the_annealed_lr_after_the_hold() -> None:
    n, numel, total = 4, 1024, 40
    runs = []
    for length in (total, None):
        members, clock = _lockstep(n, numel, length)
        xs, targets = _start(n, numel)
        _train(members, clock, xs, targets, total, lambda t: 0.05)
        runs.append(xs)
    # the same bits while the outer lr is held (the first round after the hold mixes at step
    # 16, where 0.5 still holds), different ones after it
    a, b = runs
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    members, clock = _lockstep(n, numel, total)
    xs, targets = _start(n, numel)
    _train(members, clock, xs, targets, int(HOLD * total), lambda t: 0.05)
    held, clock2 = _lockstep(n, numel, None)
    ys, _ = _start(n, numel)
    _train(held, clock2, ys, targets, int(HOLD * total), lambda t: 0.05)
    assert all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_the_wait_free_gossip_takes_the_annealed_lr_too() -> None:
    n, numel, total = 4, 1024, 60
    finals = []
    for length in (total, None):
        sim = WaitFreeSimulator(n, numel, periods=[1] * n, delay=1, total_steps=length, **SLOW)
        xs, targets = _start(n, numel)
        for t in range(total):
            for g, x, c in zip(sim.members, xs, targets, strict=True):
                g.prepare()
                x.sub_(0.05 * (x - c))
                g.end_step(x)
            sim.now = float(t + 1)
        finals.append(torch.stack(xs))
    assert not torch.equal(*finals)


def test_with_the_step_shrinking_the_annealed_gossip_reaches_the_codecs_floor() -> None:
    # Four members pulled toward four different optima (a training-like drift), 2-bit gossip
    # of one fragment in four every 4 steps with the slow-link outer step; the inner step
    # follows a cosine to 0 over the run, then stays at 0 for as many rounds again.
    n, numel, total = 4, 1024, 800

    def lr_at(t: int) -> float:
        return 0.05 * 0.5 * (1 + math.cos(math.pi * min(t, total) / total))

    ends = {}
    for length in (total, None):
        members, clock = _lockstep(n, numel, length)
        xs, targets = _start(n, numel)
        d = _train(members, clock, xs, targets, 2 * total, lr_at)
        ends[length] = d
    annealed, constant = ends[total], ends[None]
    quarter = annealed[total // 4 - 1]
    # the consensus distance falls as the step shrinks ...
    assert annealed[total - 1] < 0.01 * quarter
    # ... and, the step at 0, on to the codec's floor: 2-bit error-feedback gossip of equal
    # inputs converges geometrically (docs/gossip_tuning.md), limited by float32 rounding
    assert annealed[-1] < 1e-6 * quarter
    # the annealed outer step ends closer together than the constant one at every late mark
    assert all(annealed[t] < constant[t] for t in range(total // 2, total))


def _half_speed(total: int | None) -> tuple[WaitFreeSimulator, list[torch.Tensor]]:
    """Four wait-free members, the last at half speed, run for 48 ticks."""
    sim = WaitFreeSimulator(4, 1024, periods=[1, 1, 1, 2], delay=1, total_steps=total, **SLOW)
    xs, targets = _start(4, 1024)
    sim.run(xs, 48, lambda i, x, step: x.sub_(0.05 * (x - targets[i])))
    return sim, xs


def test_a_slow_wait_free_member_anneals_with_the_jobs_progress_not_its_own_steps() -> None:
    sim, _ = _half_speed(60)
    fast, slow = sim.members[0], sim.members[3]
    # the slow member took half the steps; its progress is the fast ones' (up to the rounds
    # in flight: a delay of 1 tick, a round every round_period steps)
    assert slow.steps == 24 and fast.steps == 48
    assert fast.steps - 2 * SLOW["round_period"] <= slow.progress() <= fast.steps
    # a fast member's is its own: nobody it heard from is ahead of it
    assert fast.progress() == fast.steps
    # so the slow member's outer lr is past the hold (18 of 60 steps), where its own steps
    # (24 < 18 + a round) would barely have begun to anneal
    lr = annealed_outer_lr(SLOW["outer_lr"], SLOW["outer_momentum"], slow.progress(), 60)
    assert lr < annealed_outer_lr(SLOW["outer_lr"], SLOW["outer_momentum"], slow.steps, 60)


def test_the_jobs_progress_is_kept_in_a_saved_state_and_a_bad_one_refused() -> None:
    sim, _ = _half_speed(60)
    sim.drain()
    state = sim.members[3].state_dict()
    assert state["furthest_rounds"] * SLOW["round_period"] > sim.members[3].steps
    fresh = WaitFreeSimulator(4, 1024, total_steps=60, **SLOW).members[3]
    fresh.load_state_dict(state)
    assert fresh.progress() == sim.members[3].progress() > sim.members[3].steps
    # kept even when nothing heard since shows it (a neighbour lost): the saved value stays
    fresh._links.received = [0] * len(fresh._links.received)
    assert fresh.progress() == sim.members[3].progress()
    for bad in (-1, 2.5, "7"):
        m = WaitFreeSimulator(4, 1024, total_steps=60, **SLOW).members[3]
        with pytest.raises((TypeError, ValueError), match=r"state\['furthest_rounds'\]"):
            m.load_state_dict(dict(state, furthest_rounds=bad))
        assert (m.steps, m.rounds_started, m.progress()) == (0, 0, 0)  # nothing loaded
    # a state saved before the progress was kept loads; the rounds its links hold show it
    old = {k: v for k, v in state.items() if k != "furthest_rounds"}
    m = WaitFreeSimulator(4, 1024, total_steps=60, **SLOW).members[3]
    m.load_state_dict(old)
    assert m.progress() == sim.members[3].progress()
