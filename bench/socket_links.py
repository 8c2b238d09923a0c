"""Time per round and bytes on the wire of one link between two processes: Gloo's pairs against
the TCP links on one port (:mod:`qcomm.collectives.sockets`), plain, with a token only, and
with a token and encryption.

    python bench/socket_links.py [--nbytes 532480] [--rounds 100]

For each kind of link, two local processes make their link through a rendezvous (in this
process) as the wait-free gossip does, over :class:`~qcomm.collectives.gloo.streams.GlooStreams`;
a round is one message of ``nbytes`` each way (each sends, then waits for the other's). Member 0
prints the median and quartiles of a round, the ratio to Gloo's median, and the bytes per
message on the wire (Gloo: the payload, its own headers not counted; the sockets: payload,
frame header and, encrypted, the 16-byte tag). Loopback: this measures the CPU cost of each
kind, not a slow link. Default size: the 4-bit payload of 1M floats.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import threading
import time

import torch

from qcomm.compress import QuantSpec, packed_nbytes

SETUP_ROUNDS = 5   # rounds not timed: the link is made in the first
TOKEN = "bench-token-0123456789abcdef"
# kind: SocketGroup arguments (None: Gloo's PairGroup)
KINDS: dict[str, dict | None] = {
    "gloo-pairs": None,
    "sockets": {},
    "sockets+token": {"token": TOKEN, "encrypt": False},
    "sockets+token+aes-gcm": {"token": TOKEN, "encrypt": True},
}


def _goodbye(message: torch.Tensor, sender: int) -> str | None:
    return "goodbye" if int(message[0]) == 255 else None   # messages start below 255


def _member(kind: str, port: int, member: int, nbytes: int, rounds: int, out: mp.Queue
            ) -> None:
    import torch.distributed as dist

    from qcomm.collectives.gloo.pair_group import PairGroup
    from qcomm.collectives.gloo.streams import GlooStreams
    from qcomm.collectives.sockets import SocketGroup
    from qcomm.rendezvous.seat import claim_incarnation

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    claim_incarnation(store, member)
    args = KINDS[kind]
    rendezvous = f"127.0.0.1:{port}"
    group = (PairGroup(rendezvous, member, 2, timeout_s=60) if args is None else
             SocketGroup(rendezvous, member, 2, timeout_s=60, listen="127.0.0.1:0", **args))
    streams = GlooStreams(group.ranks, None, member, [1 - member], nbytes, max_backlog=4,
                          timeout_s=60, stream_end=_goodbye, connect=group.connect)
    message = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    received = 0   # the other may be a round ahead: a take can bring two messages
    for r in range(SETUP_ROUNDS + rounds):
        t0 = time.perf_counter()
        if failed := streams.send(message.clone()):
            raise failed[0][1]
        while received <= r:
            got, err = streams.take(0)
            if err is not None:
                raise err
            received += len(got)
            if received <= r:
                streams.wait_any(10.0)
        times.append(time.perf_counter() - t0)
    wire = streams._links[0].channel
    streams.close(torch.full((nbytes,), 255, dtype=torch.uint8))   # every message has left
    per_message = getattr(wire, "bytes_sent", None)
    if per_message is not None:   # the goodbye is a message too
        per_message /= SETUP_ROUNDS + rounds + 1
    out.put((member, times[SETUP_ROUNDS:], per_message))


def measure(kind: str, nbytes: int, rounds: int) -> tuple[list[float], float]:
    """Member 0's round times (s) and bytes per message on the wire over a link of ``kind``."""
    from qcomm.rendezvous import serve
    from qcomm.testing.multiprocess import free_ports

    (port,) = free_ports(1)
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, 2),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    server.start()
    if not ready.wait(30):
        raise RuntimeError("the rendezvous did not start")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(kind, port, m, nbytes, rounds, out))
             for m in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = dict((m, (t, b)) for m, t, b in (out.get(timeout=600) for _ in procs))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        stop.set()
        server.join(5)
    times, per_message = res[0]
    return times, nbytes if per_message is None else per_message


def main() -> None:
    nbytes = packed_nbytes(1_000_000, QuantSpec(4, 128))
    ap = argparse.ArgumentParser(description="Round time and bytes on the wire of one link: "
                                             "Gloo pairs against qcomm's TCP links, plain, "
                                             "with a token, encrypted (loopback).")
    ap.add_argument("--nbytes", type=int, default=nbytes,
                    help=f"Bytes per message (default {nbytes}: the 4-bit payload of 1M "
                         "floats).")
    ap.add_argument("--rounds", type=int, default=100, help="Timed rounds per kind (default "
                                                            "100).")
    a = ap.parse_args()
    if a.rounds < 4 or a.nbytes < 2:
        ap.error(f"--rounds must be >= 4 and --nbytes >= 2, got {a.rounds} and {a.nbytes}")
    print(f"torch {torch.__version__}, 2 processes over loopback, {a.nbytes:,} bytes per "
          f"message, {a.rounds} rounds; ms per round (member 0), bytes per message on the wire")
    base = None
    for kind in KINDS:
        times, per_message = measure(kind, a.nbytes, a.rounds)
        t = sorted(1e3 * s for s in times)
        q1, q2, q3 = statistics.quantiles(t, n=4)
        base = base or q2
        print(f"  {kind:22s} median {q2:8.3f}  quartiles {q1:8.3f} .. {q3:8.3f}  "
              f"x{q2 / base:5.2f} of Gloo   {per_message:,.0f} B/message")


if __name__ == "__main__":
    main()
