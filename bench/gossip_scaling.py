"""How gossip scales from 8 to 64 nodes, against all-reduce: a simulation in one process.

For each node count N and graph, every member starts at an independent random vector and the
in-process simulator (:class:`~qcomm.collectives.memory.GossipSimulator`, bounded-staleness
CHOCO gossip in lock step, the same code path as over Gloo) runs rounds until the consensus
distance has shrunk to ``--tol`` (1e-3) of its start, at most ``--max-rounds``. 4-bit
stochastic codes in blocks of 128, the default gamma, staleness 1, uniform weights. Beside the
rounds it reports the bytes each member sent per round (from the members' CommStats: payload
plus each message's small header) and, for the same vector, what one exact average costs a
node in a ring all-reduce in fp32 and in an all-gather of 4-bit payloads (what a compressed
all-gather hook sends). No network and no clock: rounds and bytes, not seconds.

    python bench/gossip_scaling.py                         # N = 8, 16, 32, 64; ring, exponential
    python bench/gossip_scaling.py --nodes 8,16 --graphs ring --json bench/out/scaling.json
    python bench/gossip_scaling.py --wait-free-nodes 8,16  # add the wait-free gossip rows
    python bench/gossip_scaling.py --nodes 16,64 --graphs ring,exponential,one-peer-exp

``one-peer-exp`` is the time-varying one-peer exponential graph (one message per node per
round, :mod:`qcomm.collectives.gossip.schedules`); its degree column is 1 (peers per round) and
its spectral gap the per-round equivalent over one period (:func:`graph_shape`).

A run whose recent rate projects it still above the target after 1.2 x ``--max-rounds`` is
stopped early and reported as not reached (``--no-stop-early`` runs every case to
``--max-rounds``); the wait-free gossip's rows are left out unless ``--wait-free-nodes`` asks.
Why the early stop is safe, what a run costs and what the wait-free rows give:
bench/README.md, "gossip_scaling.py".
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script from a checkout: make `qcomm` importable without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from qcomm.collectives.gossip.graphs import TIME_VARYING_GRAPHS, neighbours
from qcomm.collectives.gossip.mixing import mixing_matrix, spectral_gap
from qcomm.collectives.gossip.schedules import ALL_GRAPHS, check_any_graph, hops, one_peer_matrix
from qcomm.collectives.memory import GossipSimulator, WaitFreeSimulator
from qcomm.compress import NonFiniteError, QuantSpec, packed_nbytes

SPEC = QuantSpec(4, 128, "stochastic")
STALENESS = 1
FP32_BYTES = 4
WINDOW = 50          # rounds over which the recent rate of decay is measured
PROJECTION_SLACK = 1.2  # stop only when even the optimistic projection passes max_rounds by 20 %


def allreduce_bytes(n: int, numel: int, elem_bytes: int = FP32_BYTES) -> float:
    """Bytes one node sends in a ring all-reduce (reduce-scatter, then all-gather) of a
    ``[numel]`` vector of ``elem_bytes``-byte elements over ``n`` nodes: ``2 (n - 1) / n x
    numel x elem_bytes``. Each phase passes n - 1 chunks of numel / n elements (0 for n = 1)."""
    return 2 * (n - 1) / n * numel * elem_bytes


def allgather_bytes(n: int, numel: int, spec: QuantSpec = SPEC) -> int:
    """Bytes one node sends in an all-gather of compressed payloads (each node quantizes its
    ``[numel]`` vector once and every node decodes and averages all n): ``(n - 1) x
    packed_nbytes(numel, spec)``, what a compressed all-gather hook sends (ring schedule)."""
    return (n - 1) * packed_nbytes(numel, spec)


def random_starts(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    """n independent float32 ``[numel]`` vectors, i.i.d. N(0, 1), the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


def make_simulator(kind: str, n: int, numel: int, graph: str, seed: int,
                   staleness: int = STALENESS, gamma: float | None = None
                   ) -> GossipSimulator | WaitFreeSimulator:
    """A simulator of n members: 4-bit stochastic codes, ``staleness`` (default 1), ``gamma``
    (None: the member's default; the one-peer graph has its own). ``wait-free``: every member
    at one pace, messages visible one tick later."""
    if kind == "lock-step":
        return GossipSimulator(n, numel, graph=graph, spec=SPEC, staleness=staleness, seed=seed,
                               gamma=gamma)
    return WaitFreeSimulator(n, numel, graph=graph, delay=1, spec=SPEC, staleness=staleness,
                             seed=seed, gamma=gamma)


def graph_shape(graph: str, n: int) -> tuple[int, float]:
    """(degree, spectral gap) of ``graph`` on n nodes. A static graph: its degree and
    :func:`~qcomm.collectives.gossip.mixing.spectral_gap`. The one-peer graph: 1 peer per
    round, and ``1 - s2 ** (1 / K)`` with ``s2`` the second largest singular value of the
    product of one period's K round matrices (float64): the gap a static graph would need to
    shrink the disagreement as much per round (1.0 for n a power of two: exact in K rounds)."""
    if graph not in TIME_VARYING_GRAPHS:
        return len(neighbours(graph, 0, n)), spectral_gap(mixing_matrix(graph, n))
    k = hops(n)
    if k == 0:
        return 0, 1.0
    period = torch.eye(n, dtype=torch.float64)
    for t in range(k):
        period = one_peer_matrix(t, n) @ period
    s2 = float(torch.linalg.svdvals(period)[1])
    # n a power of two: the period's product is exactly J / n, so s2 is float64 rounding
    # (~1e-16, whose K-th root would read as a gap below 1).
    return 1, 1.0 - (s2 if s2 > 1e-12 else 0.0) ** (1 / k)


def one_round(sim: GossipSimulator | WaitFreeSimulator, xs: list[torch.Tensor]) -> None:
    """Every member takes one gossip round on its ``xs[i]`` (in place). For the wait-free
    simulator one tick is one round, every member having period 1."""
    if isinstance(sim, GossipSimulator):
        sim.step(xs)
    else:
        sim.tick(xs)


def projected_rounds(log_d: list[float], target: float) -> float | None:
    """Rounds at which the distance would reach ``exp(target)`` at its rate over the last
    WINDOW rounds; ``log_d[r]``: log distance after round r (float64). None: too few rounds
    yet; inf: not shrinking."""
    r = len(log_d) - 1
    if r < WINDOW:
        return None
    rate = (log_d[r - WINDOW] - log_d[r]) / WINDOW
    return r + (log_d[r] - target) / rate if rate > 0 else math.inf


def bytes_per_round(sim: GossipSimulator | WaitFreeSimulator, rounds: int) -> float:
    """Mean over members of the bytes each sent per round (every level of its CommStats)."""
    per_member = [sum(s.bytes_sent.values()) for s in sim.stats]
    return sum(per_member) / len(per_member) / max(rounds, 1)


def run_to_tol(kind: str, n: int, graph: str, numel: int, tol: float, max_rounds: int,
               seed: int = 0, stop_early: bool = True, staleness: int = STALENESS,
               gamma: float | None = None) -> dict:
    """One case: rounds until ``distance <= tol x distance at the start``. Returns the JSON row
    without the all-reduce columns: ``rounds`` (int, None if not reached), ``outcome``
    ("reached", "max-rounds", "stopped early" or "diverged"), ``rounds_run``,
    ``projected_rounds`` (when stopped early), ``final_rel_distance``,
    ``gossip_bytes_per_round`` (mean per member), ``gamma``."""
    xs = random_starts(n, numel, seed)
    sim = make_simulator(kind, n, numel, graph, seed, staleness, gamma)
    d0 = sim.consensus_distance(xs)
    target = math.log(tol * d0)
    log_d, outcome, projection = [math.log(d0)], "max-rounds", None
    for _ in range(max_rounds):
        try:
            one_round(sim, xs)
        except NonFiniteError:
            outcome = "diverged"
            break
        d = sim.consensus_distance(xs)
        if not math.isfinite(d) or d > 1e3 * d0:
            outcome = "diverged"
            break
        log_d.append(math.log(d) if d > 0 else -math.inf)
        if d <= tol * d0:
            outcome = "reached"
            break
        projection = projected_rounds(log_d, target) if stop_early else None
        if projection is not None and projection > PROJECTION_SLACK * max_rounds:
            outcome = "stopped early"
            break
    rounds_run = len(log_d) - 1
    return {
        "rounds": rounds_run if outcome == "reached" else None, "outcome": outcome,
        "rounds_run": rounds_run,
        "projected_rounds": projection if outcome == "stopped early" else None,
        "final_rel_distance": math.exp(log_d[-1]) / d0,
        "gossip_bytes_per_round": bytes_per_round(sim, rounds_run),
        "gamma": sim.members[0].gamma,
    }


def case_row(kind: str, n: int, graph: str, args: argparse.Namespace) -> dict:
    """The full JSON row of one case: the graph's shape, the gossip run, the all-reduce costs."""
    t0 = time.perf_counter()
    run = run_to_tol(kind, n, graph, args.numel, args.tol, args.max_rounds, args.seed,
                     args.stop_early, args.staleness, args.gamma)
    per_round = run["gossip_bytes_per_round"]
    degree, gap = graph_shape(graph, n)
    return {
        "gossip": kind, "n": n, "graph": graph, "degree": degree,
        "spectral_gap": gap, "numel": args.numel,
        "bits": SPEC.bits, "staleness": args.staleness, "tol": args.tol, **run,
        "gossip_bytes_to_tol": None if run["rounds"] is None else run["rounds"] * per_round,
        "allreduce_fp32_bytes": allreduce_bytes(n, args.numel),
        "allgather_4bit_bytes": allgather_bytes(n, args.numel),
        "seconds": time.perf_counter() - t0,
    }


def rounds_cell(row: dict) -> str:
    """The table's rounds column: the count, or why there is none."""
    if row["rounds"] is not None:
        return str(row["rounds"])
    if row["outcome"] == "stopped early":
        return f"not reached (stopped at {row['rounds_run']}, ~{row['projected_rounds']:.0f})"
    return f"not reached ({row['outcome']}, {row['final_rel_distance']:.2g} left)"


def format_table(rows: list[dict], command: str) -> str:
    """One markdown table, headed by a line saying what produced it."""
    tol = f"{rows[0]['tol']:g}" if rows else "tol"
    lines = [
        f"Simulation in one process (no network, no time; bytes per node): `{command}`", "",
        f"| gossip | N | graph | degree | spectral gap | rounds to {tol} | gossip B/round "
        f"| gossip B to {tol} | ring all-reduce fp32 B/average | 4-bit all-gather B |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        to_tol = "-" if r["gossip_bytes_to_tol"] is None else f"{r['gossip_bytes_to_tol']:,.0f}"
        lines.append(
            f"| {r['gossip']} | {r['n']} | {r['graph']} | {r['degree']} "
            f"| {r['spectral_gap']:.4f} | {rounds_cell(r)} | {r['gossip_bytes_per_round']:,.0f} "
            f"| {to_tol} | {r['allreduce_fp32_bytes']:,.0f} | {r['allgather_4bit_bytes']:,} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _graphs(text: str) -> list[str]:
    return [check_any_graph(t.strip()) for t in text.split(",") if t.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--nodes", type=_ints, default=[8, 16, 32, 64],
                   help="Node counts, comma-separated (default 8,16,32,64).")
    p.add_argument("--graphs", type=_graphs, default=["ring", "exponential"],
                   help=f"Graphs, comma-separated, of {', '.join(ALL_GRAPHS)} "
                        "(default ring,exponential; the wait-free rows skip one-peer-exp).")
    p.add_argument("--numel", type=int, default=4096, help="Floats per member (default 4096).")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="Target consensus distance, relative to the start (default 1e-3).")
    p.add_argument("--max-rounds", type=int, default=2000,
                   help="Most rounds per case (default 2000).")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of the starting vectors and of the stochastic rounding.")
    p.add_argument("--stop-early", action=argparse.BooleanOptionalAction, default=True,
                   help="Stop a case whose projected rounds pass 1.2 x --max-rounds.")
    p.add_argument("--wait-free-nodes", type=_ints, default=[],
                   help="Node counts for wait-free gossip rows, e.g. 8,16 (default: none; "
                        "they cost about 8 s).")
    p.add_argument("--staleness", type=int, default=STALENESS,
                   help=f"Rounds a round is applied late, every case (default {STALENESS}).")
    p.add_argument("--gamma", type=float, default=None,
                   help="Consensus step of every case (default: each member's own default).")
    p.add_argument("--json", default="", help="Also write the rows to this JSON file.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # many tiny ops: threads only add overhead
    cases = [("lock-step", n, g) for n in args.nodes for g in args.graphs]
    cases += [("wait-free", n, g) for n in args.wait_free_nodes for g in args.graphs]
    rows = []
    for kind, n, graph in cases:
        rows.append(case_row(kind, n, graph, args))
        print(f"{kind} N={n} {graph}: {rounds_cell(rows[-1])} ({rows[-1]['seconds']:.1f} s)",
              file=sys.stderr, flush=True)
    argv_text = sys.argv[1:] if argv is None else argv
    print(format_table(rows, shlex.join(["python", "bench/gossip_scaling.py", *argv_text])))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
