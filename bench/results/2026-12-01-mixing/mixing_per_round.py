"""How much one gossip round of a fragment mixes, per graph, gamma and code: the in-process
simulator (qcomm.collectives.memory.GossipSimulator, the code path of the cluster runs).

Pure consensus (no local updates): every member starts at an independent N(0, 1) vector, the
members gossip as ASSGD does between nodes (staleness 1, ``--fragments`` fragments, one
fragment per round, nearest or stochastic rounding), and after every F rounds (each fragment
gossiped once more) the consensus distance ``sqrt(mean_i ||x_i - mean x||^2)`` is recorded,
relative to its start. An exact average (DiLoCo's all-reduce) gives 0 after one such cycle.
Also per case: the linear contraction factor per cycle ``max |1 - gamma (1 - lambda)|`` over
W's eigenvalues lambda < 1 (what gossip without compression would do), and the bytes each
member sends per cycle, against one fp32 ring all-reduce of the same vector.

    python bench/results/2026-12-01-mixing/mixing_per_round.py --nodes 4,8 \
        --json bench/results/2026-12-01-mixing/mixing_per_round.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from qcomm.collectives.gossip.graphs import neighbours
from qcomm.collectives.gossip.mixing import mixing_matrix
from qcomm.collectives.memory import GossipSimulator
from qcomm.compress import QuantSpec


def linear_factor(graph: str, n: int, gamma: float) -> float:
    """Per-round contraction of uncompressed gossip ``x <- x - gamma (I - W) x`` off the mean."""
    ev = torch.linalg.eigvalsh(mixing_matrix(graph, n).to(torch.float64))
    off = ev[:-1]  # eigvalsh sorts ascending; the last is the mean's eigenvalue 1
    return float((1 - gamma * (1 - off)).abs().max())


def run_case(n: int, graph: str, gamma: float, bits: int, rounding: str, fragments: int,
             cycles: int, numel: int, seed: int) -> dict:
    torch.manual_seed(seed)
    xs = [torch.randn(numel) for _ in range(n)]
    sim = GossipSimulator(n, numel, graph=graph, gamma=gamma, staleness=1,
                          spec=QuantSpec(bits, 128, rounding), fragments=fragments, seed=seed)
    d0 = sim.consensus_distance(xs)
    rel = []
    # Staleness 1: a fragment's round is mixed one round later, so after a cycle of F rounds
    # the last fragment's correction is still in flight (as in training).
    for _ in range(cycles):
        for _ in range(fragments):
            sim.step(xs)
        rel.append(sim.consensus_distance(xs) / d0)
    sent = sum(s.snapshot()["bytes_sent"]["inter"] for s in sim.stats) / n / cycles
    return {"nodes": n, "graph": graph, "degree": len(neighbours(graph, 0, n)), "gamma": gamma,
            "bits": bits, "rounding": rounding, "fragments": fragments,
            "linear_factor_per_cycle": linear_factor(graph, n, gamma),
            "distance_after_cycles": rel, "bytes_per_cycle": sent,
            "allreduce_fp32_bytes": 2 * (n - 1) / n * numel * 4}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="4,8", help="node counts, comma-separated")
    p.add_argument("--graphs", default="ring,exponential,complete")
    p.add_argument("--gammas", default="0.5,1.0")
    p.add_argument("--bits", default="2,4")
    p.add_argument("--rounding", default="nearest")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--cycles", type=int, default=16, help="cycles of F rounds per case")
    p.add_argument("--numel", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in (int(v) for v in args.nodes.split(",")):
        for graph in args.graphs.split(","):
            for gamma in (float(v) for v in args.gammas.split(",")):
                for bits in (int(v) for v in args.bits.split(",")):
                    rows.append(run_case(n, graph, gamma, bits, args.rounding, args.fragments,
                                         args.cycles, args.numel, args.seed))
    print("| nodes | graph | degree | gamma | bits | linear factor per cycle | distance after "
          "1 / 2 / 4 / 8 / 16 cycles | bytes per cycle vs fp32 all-reduce |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["distance_after_cycles"]
        pick = " / ".join(f"{d[k - 1]:.3g}" for k in (1, 2, 4, 8, 16) if k <= len(d))
        print(f"| {r['nodes']} | {r['graph']} | {r['degree']} | {r['gamma']:g} | {r['bits']} | "
              f"{r['linear_factor_per_cycle']:.3f} | {pick} | "
              f"{r['bytes_per_cycle'] / r['allreduce_fp32_bytes']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
