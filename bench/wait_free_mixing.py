"""Which copies should a wait-free gossip mix with? Four rules, side by side in the simulator.

Every member mixes ``x_f += gamma * sum_j w_ij (copy_j[f] - own_j[f])`` at each of its rounds;
the rules differ in the own copy ``own_j`` each neighbour's copy is compared with, and in which
neighbours count:

* ``lagged`` (qcomm's): ``own_j`` is the member's copy without its last ``staleness`` (1)
  messages, for every neighbour, at every round: the bounded-staleness mode's comparison;
* ``fresh``: ``own_j`` is the member's fresh copy (every message it sent);
* ``new-only``: as ``lagged``, but a neighbour counts only when a message of it arrived for
  that fragment since the member last mixed it (edges mix at the slower end's pace);
* ``matched``: ``own_j`` holds as many of the member's rounds as ``copy_j`` holds of j's
  (copies of equal age, so the term is their disagreement, not the progress in between), each
  neighbour's term counted once per new message of it (without that, a late neighbour's term
  is added again at every round and the gossip diverges).

Two problems on a ring of 4, 4-bit stochastic codes, ``gamma`` 0.3, for member periods (1 = a
step every tick; 5 = five times slower) and message delays in ticks:

* consensus: no local updates, random starts; how far the agreed value moves from the starting
  average (relative), and the final consensus distance;
* training: member i takes steps ``x -= 0.05 (x - c_i - drift t)`` (different optima, and with
  ``--drift`` > 0 optima that keep moving, as a trained model's parameters do); the relative
  distance of the members' average from ``mean(c_i) + drift t`` after 600 ticks.

    python bench/wait_free_mixing.py --drift 0      # fixed optima
    python bench/wait_free_mixing.py --drift 0.01   # moving optima
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from qcomm.collectives.gossip.wait_free import WaitFreeGossip
from qcomm.collectives.memory import WaitFreeSimulator
from qcomm.compress import QuantSpec

RULES = ("lagged", "fresh", "new-only", "matched")


def _install(sim: WaitFreeSimulator, rule: str) -> None:
    """Replace every member's mixing step by ``rule``'s (``lagged`` is the code's own)."""
    for m in sim.members:
        if rule == "lagged":
            continue
        seen = [[0] * m.fragments for _ in m.peers]   # messages per (neighbour, fragment)
        mixed = [[0] * m.fragments for _ in m.peers]  # ... at the member's last mix of f
        sent: list[tuple[int, torch.Tensor]] = []     # (round, decoded delta of hat_own)

        def apply_pending(m: WaitFreeGossip = m, seen: list = seen) -> None:
            for k, msgs in enumerate(m._pending):
                for r, _ in msgs:
                    seen[k][r % m.fragments] += 1
            WaitFreeGossip._apply_pending(m)

        def end_step(x: torch.Tensor | None, m: WaitFreeGossip = m,
                     sent: list = sent) -> list[int]:
            before = None if m._hat_own is None else m._hat_own.clone()
            m.bench_before = before  # the own copy without this round's message
            t = m.rounds_started
            out = WaitFreeGossip.end_step(m, x)
            if before is not None and x is not None and m.rounds_started > t:
                sent.append((t, m._hat_own - before))
                del sent[:-64]
            return out

        def mix(x: torch.Tensor, f: int, t: int, m: WaitFreeGossip = m, seen: list = seen,
                mixed: list = mixed, sent: list = sent) -> None:
            frag = m.fragment(f)
            w = m._weights_at(t, x.device)[0].clone()  # 0 for a neighbour not mixed at t
            correction = torch.zeros(frag.stop - frag.start, dtype=torch.float64)
            for k in range(len(m.peers)):
                if rule in ("new-only", "matched"):
                    if seen[k][f] == mixed[k][f]:
                        w[k] = 0.0
                    mixed[k][f] = seen[k][f]
                if rule == "fresh":
                    own = m._hat_own[frag].double()
                else:  # without this round's message (the code's own copy, staleness 1) ...
                    own = m.bench_before[frag].double()
                if rule == "matched":  # ... and without the rounds copy k has not matched
                    for r, d in sent:
                        if r >= m.received[k]:
                            own = own - d[frag].double()
                correction += float(w[k]) * (m._copies[k, frag].double() - own)
            x[frag].add_(correction.float(), alpha=m.gamma)

        m._apply_pending = apply_pending
        m.end_step = end_step
        m._mix = mix


def run(rule: str, periods: list[int], delay: int, numel: int, seed: int,
        drift: float = 0.01) -> dict:
    spec = QuantSpec(4, 128, "stochastic")
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"rule": rule, "periods": periods, "delay": delay}
    # consensus
    sim = WaitFreeSimulator(4, numel, periods=periods, delay=delay, spec=spec, gamma=0.3)
    _install(sim, rule)
    xs = [torch.randn(numel, generator=gen) for _ in range(4)]
    start = torch.stack([x.double() for x in xs]).mean(0)
    sim.run(xs, 300)
    sim.drain()
    end = torch.stack([x.double() for x in xs]).mean(0)
    out["consensus_mean_moved"] = float((end - start).norm() / start.norm())
    out["consensus_distance"] = sim.consensus_distance(xs)
    # training
    sim = WaitFreeSimulator(4, numel, periods=periods, delay=delay, spec=spec, gamma=0.3)
    _install(sim, rule)
    centers = [torch.randn(numel, generator=gen) for _ in range(4)]
    xs = [torch.zeros(numel) for _ in range(4)]

    def update(i: int, x: torch.Tensor, step: int) -> None:
        x.sub_(0.05 * (x - centers[i] - drift * sim.now))

    sim.run(xs, 600, update)
    sim.drain()
    optimum = torch.stack([c.double() for c in centers]).mean(0) + drift * (sim.now - 1)
    avg = torch.stack([x.double() for x in xs]).mean(0)
    out["training_gap"] = float((avg - optimum).norm() / optimum.norm())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--numel", type=int, default=4096, help="Floats per member.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the starts and the optima.")
    p.add_argument("--drift", type=float, default=0.01,
                   help="How fast every member's optimum moves, per tick (0: fixed optima).")
    p.add_argument("--json", default="", help="Also write the rows here.")
    args = p.parse_args(argv)
    cases = [([1, 1, 1, 1], 1), ([2, 1, 1, 1], 1), ([5, 1, 1, 1], 1), ([5, 1, 1, 1], 3)]
    rows = []
    print(f"{'rule':<9} {'periods':<13} {'delay':>5}  {'mean moved':>10}  {'consensus':>10}  "
          f"{'training gap':>12}")
    for periods, delay in cases:
        for rule in RULES:
            r = run(rule, periods, delay, args.numel, args.seed, args.drift)
            rows.append(r)
            print(f"{rule:<9} {periods!s:<13} {delay:>5}  {r['consensus_mean_moved']:>10.3g}  "
                  f"{r['consensus_distance']:>10.3g}  {r['training_gap']:>12.3g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
