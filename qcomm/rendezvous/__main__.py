"""``python -m qcomm.rendezvous --host H --port P --nodes N``: the job's rendezvous
(:mod:`.server`)."""

from __future__ import annotations

import argparse

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
    args = ap.parse_args(argv)
    try:
        serve(args.host, args.port, args.nodes, max_nodes=args.max_nodes)
    except (ValueError, RuntimeError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
