"""Receives before sends, or sends before receives? Round latency of the gossip transport.

    python bench/gossip_transport.py [--procs 3] [--nbytes 532480] [--rounds 200]

``procs`` local processes (one per emulated node, Gloo over loopback) exchange one uint8 payload
of ``nbytes`` per round with their ring neighbours through
:class:`qcomm.collectives.gloo.transport.GlooTransport`, posting the receives first
(``recv_first=True``, what gossip does) or the sends first. The two orders alternate in blocks
of 10 rounds, so both see the same machine load. Rank 0 prints the median and quartiles of the
time from posting a round to its completion, per order, and the ratio of the medians. Default
size: the 4-bit payload of 1M floats (``packed_nbytes(1_000_000, QuantSpec(4, 128))``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from qcomm.collectives.gloo.transport import GlooTransport
from qcomm.collectives.gossip.graphs import neighbours
from qcomm.compress import QuantSpec, packed_nbytes

SETUP_ROUNDS = 5  # rounds of each order not timed: the connections are set up in them
BLOCK = 10        # rounds of one order in a row

ORDERS = ("recv-first", "send-first")


def _body(rank: int, world: int, nbytes: int, rounds: int) -> dict[str, list[float]]:
    peers = neighbours("ring", rank, world)
    transports = {
        order: GlooTransport(list(range(world)), None, rank, peers,
                             recv_first=(order == "recv-first"))
        for order in ORDERS
    }
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    recv = torch.empty(len(peers), nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {order: [] for order in ORDERS}
    for block in range(2 * rounds // BLOCK):
        order = ORDERS[block % 2]
        dist.barrier()
        for i in range(BLOCK):
            t0 = time.perf_counter()
            transports[order].exchange(block * BLOCK + i, payload, recv).wait(60.0)
            times[order].append(time.perf_counter() - t0)
    return times


def main() -> None:
    from qcomm.testing.multiprocess import run_world

    nbytes = packed_nbytes(1_000_000, QuantSpec(4, 128))
    ap = argparse.ArgumentParser(
        description="Receives before sends, or sends before receives? Measures the round "
                    "latency of the gossip transport (Gloo over loopback, ring neighbours) in "
                    "both orders, alternating, and prints their medians and ratio from rank 0.")
    ap.add_argument("--procs", type=int, default=3,
                    help="Local processes, one per emulated node (default 3).")
    ap.add_argument("--nbytes", type=int, default=nbytes,
                    help=f"Bytes per message (default {nbytes}: the 4-bit payload of 1M "
                         f"floats).")
    ap.add_argument("--rounds", type=int, default=200,
                    help=f"Rounds per order, a multiple of {BLOCK} (default 200).")
    a = ap.parse_args()
    if a.rounds < BLOCK or a.rounds % BLOCK or a.procs < 2 or a.nbytes < 1:
        ap.error(f"--rounds must be a multiple of {BLOCK} (the orders alternate in blocks of "
                 f"{BLOCK}; the first {SETUP_ROUNDS} of each set up the connections and are "
                 f"not timed), --procs >= 2 and --nbytes >= 1, got {a.rounds}, {a.procs}, "
                 f"{a.nbytes}")
    res = run_world(_body, a.procs, args=(a.nbytes, a.rounds), timeout_s=600)
    print(f"torch {torch.__version__}, {a.procs} procs (ring, Gloo over loopback), "
          f"{a.nbytes:,} bytes per message, {a.rounds} rounds per order; ms per round (rank 0)")
    med = {}
    for order in ORDERS:
        t = sorted(1e3 * s for s in res[0][order][SETUP_ROUNDS:])
        q1, q2, q3 = statistics.quantiles(t, n=4)
        med[order] = q2
        print(f"  {order:10s} median {q2:7.3f}   quartiles {q1:7.3f} .. {q3:7.3f}")
    print(f"  send-first / recv-first median: {med['send-first'] / med['recv-first']:.3f}")


if __name__ == "__main__":
    main()
