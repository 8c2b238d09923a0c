"""``python -m qcomm.rendezvous --host H --port P --nodes N``: the job's rendezvous
(:mod:`.server`)."""

from __future__ import annotations

import argparse
import os

from .server import serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qcomm.rendezvous",
        description="The rendezvous of a qcomm job: a process of its own that outlives every "
                    "node. Start it first, on a machine that stays up; every node names it "
                    "with QCOMM_RENDEZVOUS=HOST:PORT. With QCOMM_TOKEN set (in the "
                    "environment, never on a command line) only the nodes that hold the same "
                    "token get in, and what they say to it is encrypted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    ap.add_argument("--port", type=int, default=29400, help="TCP port to listen on.")
    ap.add_argument("--nodes", type=int, required=True,
                    help="Nodes the job starts with (each runs its own torchrun).")
    ap.add_argument("--max-nodes", type=int, default=None,
                    help="Nodes the job may grow to (default: --nodes): with nodes linked "
                         "through the rendezvous (qcomm.rendezvous.init_node), a node started "
                         "later takes a seat beyond --nodes and joins the running job.")
    ap.add_argument("--relay-port", type=int, default=None,
                    help="Also relay, on this port (default: QCOMM_RELAY_PORT, else none), "
                         "the links whose two ends both accept nothing (nodes behind a NAT, "
                         "without QCOMM_LISTEN): both dial it, and it carries their sealed "
                         "bytes.")
    ap.add_argument("--relay-advertise", default=None,
                    help="HOST:PORT the nodes dial to reach the relay, when it is not "
                         "--host:--relay-port (a forwarded port, a wildcard --host).")
    args = ap.parse_args(argv)
    relay_port = args.relay_port
    if relay_port is None and os.environ.get("QCOMM_RELAY_PORT"):
        try:
            relay_port = int(os.environ["QCOMM_RELAY_PORT"])
        except ValueError:
            ap.error(f"QCOMM_RELAY_PORT must be a port (1..65535), got "
                     f"{os.environ['QCOMM_RELAY_PORT']!r}")
    try:
        serve(args.host, args.port, args.nodes, max_nodes=args.max_nodes,
              relay_port=relay_port, relay_advertise=args.relay_advertise)
    except (ValueError, RuntimeError) as e:
        ap.error(str(e).replace("relay_port", "--relay-port")
                 .replace("relay_advertise", "--relay-advertise"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
