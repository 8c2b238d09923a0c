"""How many rounds gossip with zero updates needs to shrink the consensus distance by 1e3, over
a grid of gamma, for each code width and staleness: the measurement behind
:func:`qcomm.collectives.gossip.default_gamma` (results and reading in docs/gossip_tuning.md).

    python bench/tune_gamma.py [--numel 1024] [--bits 8 4 2 1] [--fragments 1 2] [--out gamma.json]

Each case: members start at x_i ~ N(0, 1) i.i.d. (seeded), stochastic rounding, blocks of 128,
uniform weights, the in-process simulator (same code as over Gloo). A case stops when the
distance reaches 1e-3 of its start (converged), exceeds 1e3 times its start or goes non-finite
(diverged), or runs out of rounds (``None``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script from a checkout: make `qcomm` importable without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from qcomm.collectives.memory import GossipSimulator
from qcomm.compress import NonFiniteError, QuantSpec

GRAPHS = (("ring", 4), ("ring", 8), ("exponential", 8))
GAMMAS = {8: (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0),
          1: (0.02, 0.05, 0.1, 0.2, 0.3, 0.4)}
GAMMAS[4] = GAMMAS[2] = GAMMAS[8]
MAX_ROUNDS = {8: 600, 4: 600, 2: 600, 1: 1500}


def rounds_to_converge(n: int, graph: str, bits: int, tau: int, gamma: float, numel: int,
                       max_rounds: int, seed: int = 0,
                       fragments: int = 1) -> int | str | None:
    """Rounds until the consensus distance is <= 1e-3 of its start; "div" if it diverged;
    None if ``max_rounds`` was not enough. With ``fragments`` F > 1 each round gossips one
    of F fragments in turn (every fragment once per F rounds)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    sim = GossipSimulator(n, numel, graph=graph, spec=QuantSpec(bits, 128, "stochastic"),
                          staleness=tau, gamma=gamma, seed=seed,
                          fragments=fragments)
    d0 = sim.consensus_distance(xs)
    for r in range(1, max_rounds + 1):
        try:
            sim.step(xs)
        except NonFiniteError:
            return "div"
        d = sim.consensus_distance(xs)
        if not d <= 1e3 * d0:
            return "div"
        if d <= 1e-3 * d0:
            return r
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Measure, in the in-process gossip simulator, how many rounds gossip with "
                    "zero updates needs to shrink the consensus distance by 1e3, for each code "
                    "width, staleness, graph and gamma of a grid: the data behind qcomm's "
                    "default gamma (docs/gossip_tuning.md).")
    ap.add_argument("--numel", type=int, default=1024,
                    help="Floats each member gossips (default 1024).")
    ap.add_argument("--bits", type=int, nargs="*", default=[8, 4, 2, 1],
                    help="Code widths to measure (default: 8 4 2 1).")
    ap.add_argument("--taus", type=int, nargs="*", default=[0, 1, 2],
                    help="Staleness values to measure (default: 0 1 2).")
    ap.add_argument("--gammas", type=float, nargs="*", default=None,
                    help="Gammas to try, smallest first (default: a grid per code width; a "
                         "case stops at the first gamma that diverges).")
    ap.add_argument("--fragments", type=int, nargs="*", default=[1],
                    help="Fragment counts to measure (default: 1, whole vectors); with "
                         "fragments > staleness each fragment's correction lands before it is "
                         "sent again.")
    ap.add_argument("--out", default=None,
                    help="Write the results to this JSON file (default: print only).")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for bits in args.bits:
        for tau in args.taus:
            for frags in args.fragments:
                for graph, n in GRAPHS:
                    for gamma in args.gammas or GAMMAS[bits]:
                        t0 = time.perf_counter()
                        r = rounds_to_converge(n, graph, bits, tau, gamma, args.numel,
                                               MAX_ROUNDS[bits] * frags, fragments=frags)
                        results.append({"bits": bits, "tau": tau, "fragments": frags,
                                        "graph": graph, "n": n, "gamma": gamma, "rounds": r})
                        print(f"bits={bits} tau={tau} fragments={frags} {graph}{n} "
                              f"gamma={gamma}: {r} ({time.perf_counter() - t0:.1f} s)",
                              flush=True)
                        if r == "div":  # larger gammas diverge as well
                            break
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
