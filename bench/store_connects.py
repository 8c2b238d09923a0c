"""How long a connection to torch's store takes on this host, one after another.

    python bench/store_connects.py [--connects 60] [--slow-s 0.5]
    RES_OPTIONS="timeout:1 attempts:3" python bench/store_connects.py

Every process of a job connects to a store (the rendezvous, its links' groups), and torch's
store client and server each name the connection by a reverse lookup of the peer's address
(``getnameinfo``; on a dual-stack socket ``::ffff:127.0.0.1``, which no hosts file lists, so
the lookup goes to the DNS server). Where that server drops a query, the connect waits the
resolver's timeout (5 s unless ``resolv.conf`` or ``RES_OPTIONS`` says otherwise), and the
server's wait happens on its one event thread, so every client of that store waits with it.
This connects ``--connects`` clients in turn to a store served in this process and prints the
median and slowest connect and each connect slower than ``--slow-s``, with the resolver's
options in effect.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from bench.common import environment, print_environment, write_json
from qcomm.testing.multiprocess import free_ports


def resolver_options() -> str:
    """The resolver's options: ``RES_OPTIONS`` when set, else the ``options`` lines of
    /etc/resolv.conf ("" when neither says anything: glibc's 5 s timeout, 2 attempts)."""
    if os.environ.get("RES_OPTIONS"):
        return f"RES_OPTIONS={os.environ['RES_OPTIONS']}"
    try:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
    except OSError:
        return ""
    return "; ".join(line.strip() for line in lines if line.startswith("options"))


def connect_times(connects: int, timeout_s: float) -> list[float]:
    """Seconds each of ``connects`` store clients took to connect, in order, to one store
    served in this process on 127.0.0.1."""
    (port,) = free_ports(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timeout)
    times = []
    for _ in range(connects):
        t0 = time.perf_counter()
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        times.append(time.perf_counter() - t0)
        del client
    del server
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Connect store clients one after another to a store in this process and "
                    "report how long each connect took (the host's name lookups show here).")
    ap.add_argument("--connects", type=int, default=60,
                    help="clients connected in turn (default 60).")
    ap.add_argument("--slow-s", type=float, default=0.5,
                    help="a connect slower than this is listed (default 0.5).")
    ap.add_argument("--out", default="",
                    help="JSON output path (default bench/out/store_connects.json).")
    args = ap.parse_args(argv)
    if args.connects < 1:
        ap.error(f"--connects must be at least 1, got {args.connects}")
    if args.slow_s <= 0:
        ap.error(f"--slow-s must be above 0, got {args.slow_s}")
    env = environment(torch.device("cpu"))
    print_environment(env)
    options = resolver_options()
    times = connect_times(args.connects, timeout_s=30.0)
    slow = [(i, t) for i, t in enumerate(times) if t > args.slow_s]
    print(f"resolver options: {options or '(none: 5 s timeout, 2 attempts)'}")
    print(f"{len(times)} connects: median {1e3 * statistics.median(times):.2f} ms, slowest "
          f"{max(times):.3f} s, {len(slow)} slower than {args.slow_s:g} s"
          + (": " + ", ".join(f"#{i} {t:.2f} s" for i, t in slow) if slow else ""))
    out = (Path(args.out) if args.out else
           Path(__file__).resolve().parent / "out" / "store_connects.json")
    write_json(out, {"environment": env, "resolver_options": options, "times_s": times,
                     "slow": [i for i, _ in slow], "slow_s": args.slow_s})
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
