"""A process that is not of the job tries a link on a running member's port, for the admission
tests (``tests/collectives/sockets/test_admission_processes.py``): it reads the member's
address from the rendezvous (as anyone who can reach the port could learn it) and dials it
naming a real link of the job, with ``--token`` (the wrong one) or none; ``--mode garbage``
sends gossip-sized bytes with no handshake at all. It prints what happened on one line and
exits 0 when it was refused. ``--to relay`` tries the rendezvous's relay instead, asking for
that link (the relay tests).

    QCOMM_TOKEN=wrong... python -m qcomm.testing.stray_link --port P --mode token
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch.distributed as dist

from qcomm.collectives.sockets.listener import parse_listen
from qcomm.rendezvous.link_relay import RELAY_KEY, RELAY_LINK
from qcomm.wire.admission import AdmissionError, dial
from qcomm.wire.frames import FrameError

# The link between members 0 and 1 (first incarnations, first link) of the rail "rail0".
LINK = "qcomm/link/rail0/0.1-1.1/1/"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True, help="the rendezvous's port")
    ap.add_argument("--mode", choices=["token", "garbage"], required=True)
    ap.add_argument("--to", choices=["member", "relay"], default="member",
                    help="member 0's port, or the rendezvous's relay (asking for that link)")
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    at = RELAY_KEY if args.to == "relay" else f"{LINK}addr/0"
    host, port = parse_listen(store.get(at).decode())
    sock = socket.create_connection((host, port), timeout=10)
    if args.mode == "garbage":
        sock.sendall(os.urandom(4096))
        try:
            answer = sock.recv(1 << 16)
            while sock.recv(1 << 16):
                pass
        except OSError as e:
            answer = str(e).encode()
        print(f"garbage: the port answered {len(answer)} bytes and closed", flush=True)
        return
    token = os.environ.get("QCOMM_TOKEN")
    try:
        hello = ({"link": RELAY_LINK, "pair": LINK, "side": "dial"} if args.to == "relay" else
                 {"link": LINK, "member": 1, "incarnation": 1})
        dial(sock, hello, token.encode() if token else None)
    except (AdmissionError, FrameError) as e:
        print(f"refused: {type(e).__name__}: {e}", flush=True)
        return
    print("admitted", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
