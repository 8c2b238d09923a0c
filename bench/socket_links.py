"""Time per round, bytes on the wire and CPU per byte of one link between two processes: Gloo's
pairs against the TCP links on one port (:mod:`qcomm.collectives.sockets`), plain, with a token
only, and with a token and encryption, and (``sockets+relay``) encrypted through the relay of
the links whose two ends both accept nothing (:mod:`qcomm.rendezvous.link_relay`, a process of
its own on member 0's machine).

    python bench/socket_links.py [--nbytes 531252] [--rounds 100] [--reps 1]
    python bench/socket_links.py --link 100mbit --link 1gbit --link 100mbit:50 \\
        --rounds 30 --reps 5                       # root: the emulated cluster's links

Two member processes make one link of every kind through a rendezvous (in member 0's process)
as the wait-free gossip does, over :class:`~qcomm.collectives.gloo.streams.GlooStreams`; a round
is one message of ``nbytes`` each way (each sends, then waits for the other's). The kinds run
interleaved, ``--rounds`` rounds of each in turn, ``--reps`` times, so that a change of the
machine's load falls on every kind alike; each kind's figure is the median over its reps of
the rep's median round, its ratio the median over reps of the rep's ratio to Gloo's.

Without ``--link`` both members run on loopback: that measures the CPU cost of each kind, not a
slow link. ``--link RATE[:DELAY_MS]`` (repeated; root) runs them in a 2-node emulated cluster
(bench/cluster/netns.sh: each node's port shaped to RATE, DELAY_MS more each way through the
delay line), one cluster per link; bytes on the wire are then the sender's interface counter
(TCP/IP headers and the ACKs of what it received included) per message. CPU per byte is member
0's process time (all its threads) over the payload bytes it sent and received. Default size:
the 4-bit payload of 1M floats.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from qcomm.compress import QuantSpec, packed_nbytes

HERE = Path(__file__).resolve().parent
NETNS = HERE / "cluster" / "netns.sh"
IFACE = "qceth0"   # every emulated node's link (netns.sh)
SETUP_ROUNDS = 5   # rounds not timed: the link is made in the first
TOKEN = "bench-token-0123456789abcdef"
# kind: SocketGroup arguments (None: Gloo's PairGroup)
KINDS: dict[str, dict | None] = {
    "gloo-pairs": None,
    "sockets": {},
    "sockets+token": {"token": TOKEN, "encrypt": False},
    "sockets+token+aes-gcm": {"token": TOKEN, "encrypt": True},
    # neither end listens: the link goes through the relay (a process of its own)
    "sockets+relay": {"token": TOKEN, "encrypt": True, "listen": ""},
}
RELAYED = "sockets+relay"
# The relay's process: a LinkRelay on argv[1]'s host, its port on the first line out.
RELAY = """
import sys
from qcomm.rendezvous.link_relay import LinkRelay
relay = LinkRelay(sys.argv[1], 0, sys.argv[2].encode())
print(relay.port, flush=True)
sys.stdin.read()   # until the bench closes it
"""


def _goodbye(message: torch.Tensor, sender: int) -> str | None:
    return "goodbye" if int(message[0]) == 255 else None   # messages start below 255


def _tx_bytes() -> int | None:
    """Bytes sent by this namespace's emulated link so far (None: not in a cluster)."""
    path = Path(f"/sys/class/net/{IFACE}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else None


def _links(kinds: list[str], rendezvous: str, member: int, host: str, nbytes: int) -> dict:
    """One link of each kind to the other member, made and warmed up (:data:`SETUP_ROUNDS`)."""
    from qcomm.collectives.gloo.pair_group import PairGroup
    from qcomm.collectives.gloo.streams import GlooStreams
    from qcomm.collectives.sockets import SocketGroup

    out = {}
    for kind in kinds:
        args = KINDS[kind]
        name = f"bench-{kind}"
        group = (PairGroup(rendezvous, member, 2, timeout_s=60, name=name) if args is None
                 else SocketGroup(rendezvous, member, 2, timeout_s=60, name=name,
                                  **{"listen": f"{host}:0", **args}))
        out[kind] = [GlooStreams(group.ranks, None, member, [1 - member], nbytes, max_backlog=4,
                                 timeout_s=60, stream_end=_goodbye, connect=group.connect), 0, 0]
    return out


def _rounds(link: list, message: torch.Tensor, n: int) -> list[float]:
    """``n`` rounds on ``link`` ([streams, messages received, rounds run]): seconds each."""
    streams = link[0]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if failed := streams.send(message.clone()):
            raise failed[0][1]
        link[2] += 1   # the other may be a round ahead: a take can bring two messages
        while link[1] < link[2]:
            got, err = streams.take(0)
            if err is not None:
                raise err
            link[1] += len(got)
            if link[1] < link[2]:
                streams.wait_any(10.0)
        times.append(time.perf_counter() - t0)
    return times


def member_main(member: int, rendezvous: str, host: str, kinds: list[str], nbytes: int,
                rounds: int, reps: int, relay: str | None = None) -> dict | None:
    """One member's part; member 0 serves the rendezvous (naming ``relay`` as its relay) and
    returns the measurements."""
    import datetime

    import torch.distributed as dist

    from qcomm.rendezvous import serve
    from qcomm.rendezvous.seat import claim_incarnation, parse_address

    torch.set_num_threads(1)
    r_host, r_port = parse_address(rendezvous)
    stop = threading.Event()
    if member == 0:
        ready = threading.Event()
        threading.Thread(target=serve, args=(r_host, r_port, 2), daemon=True,
                         kwargs={"ready": ready, "stop": stop, "token": None}).start()
        if not ready.wait(60):
            raise RuntimeError("the rendezvous did not start")
    store = dist.TCPStore(r_host, r_port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    if member == 0 and relay is not None:
        from qcomm.rendezvous.link_relay import RELAY_KEY

        store.set(RELAY_KEY, relay)   # before this member's first link: the other reads it
    claim_incarnation(store, member)
    links = _links(kinds, rendezvous, member, host, nbytes)
    message = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    for link in links.values():
        _rounds(link, message, SETUP_ROUNDS)
    res: dict[str, list] = {k: [] for k in kinds}
    for _ in range(reps):
        for kind in kinds:
            tx0, cpu0 = _tx_bytes(), time.process_time()
            times = _rounds(links[kind], message, rounds)
            cpu, tx1 = time.process_time() - cpu0, _tx_bytes()
            res[kind].append({"times": times, "cpu_s": cpu,
                              "wire": None if tx0 is None else (tx1 - tx0) / rounds})
    for link in links.values():
        link[0].close(torch.full((nbytes,), 255, dtype=torch.uint8))   # every message has left
    # the other member's last messages are read before the rendezvous goes
    store.set(f"bench/done/{member}", "1")
    store.wait([f"bench/done/{1 - member}"], datetime.timedelta(seconds=60))
    stop.set()
    return res if member == 0 else None


def _run_pair(kinds: list[str], nbytes: int, rounds: int, reps: int,
              cluster: str | None) -> dict:
    """Both members as processes (in the cluster's namespaces when ``cluster`` is given)."""
    from qcomm.testing.multiprocess import free_port

    hosts = ["10.77.0.1", "10.77.0.2"] if cluster else ["127.0.0.1", "127.0.0.1"]
    rendezvous = f"{hosts[0]}:{47100 if cluster else free_port()}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME=IFACE if cluster else "lo", OMP_NUM_THREADS="1")
    env.pop("QCOMM_TOKEN", None)
    procs = []
    relay = None
    if RELAYED in kinds:   # on node 0's machine, as the rendezvous's relay would be
        ns = ["ip", "netns", "exec", f"qcb{cluster}n0"] if cluster else []
        procs.append(subprocess.Popen([*ns, sys.executable, "-c", RELAY, hosts[0], TOKEN],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))
        relay = f"{hosts[0]}:{int(procs[0].stdout.readline())}"
    for m in (0, 1):
        ns = ["ip", "netns", "exec", f"qcb{cluster}n{m}"] if cluster else []
        procs.append(subprocess.Popen(
            [*ns, sys.executable, __file__, "--member", str(m), "--rendezvous", rendezvous,
             "--host", hosts[m], "--kinds", ",".join(kinds), "--nbytes", str(nbytes),
             "--rounds", str(rounds), "--reps", str(reps),
             *(["--relay", relay] if relay else [])], env=env, stdout=subprocess.PIPE,
            text=True))
    members = procs[-2:]
    outs = [p.communicate(timeout=1200)[0] for p in members]
    if relay is not None:
        procs[0].communicate(timeout=60)   # stdin closed: the relay ends
    if any(p.returncode for p in members):
        raise RuntimeError(f"a member failed: exit codes {[p.returncode for p in members]}")
    return json.loads(outs[0].strip().splitlines()[-1].removeprefix("RESULT "))


def measure(link: str | None, kinds: list[str], nbytes: int, rounds: int, reps: int) -> dict:
    """The measurements of every kind over ``link`` (``RATE[:DELAY_MS]``; None: loopback)."""
    if link is None:
        return _run_pair(kinds, nbytes, rounds, reps, None)
    rate, _, delay = link.partition(":")
    cluster = "sl" + secrets.token_hex(2)
    up = ["bash", str(NETNS), "up", "--id", cluster, "--nodes", "2", "--rate", rate,
          "--owner", str(os.getpid()), *(["--delay-ms", delay] if delay else [])]
    try:
        subprocess.run(up, check=True, stdout=subprocess.DEVNULL)
        return _run_pair(kinds, nbytes, rounds, reps, cluster)
    finally:
        subprocess.run(["bash", str(NETNS), "down", "--id", cluster], check=False)


def summary(res: dict, nbytes: int) -> list[str]:
    """One line per kind: median ms per round and its ratio to the first kind's (medians over
    reps), bytes on the wire per message, CPU ns per payload byte."""
    base = next(iter(res))
    lines = []
    for kind, runs in res.items():
        meds = [statistics.median(r["times"]) * 1e3 for r in runs]
        ratios = [m / statistics.median(b["times"]) / 1e3
                  for m, b in zip(meds, res[base], strict=True)]
        cpu = statistics.median(r["cpu_s"] / (2 * nbytes * len(r["times"])) * 1e9 for r in runs)
        wire = [r["wire"] for r in runs if r["wire"] is not None]
        shown = f"{statistics.median(wire):,.0f}" if wire else "-"
        lines.append(f"  {kind:22s} {statistics.median(meds):9.2f} ms [{min(meds):.2f}-"
                     f"{max(meds):.2f}]  x{statistics.median(ratios):5.2f} of {base}   "
                     f"wire {shown} B/message   CPU {cpu:6.2f} ns/byte")
    return lines


def main() -> None:
    nbytes = packed_nbytes(1_000_000, QuantSpec(4, 128))
    ap = argparse.ArgumentParser(description="Round time, bytes on the wire and CPU per byte "
                                             "of one link: Gloo pairs against qcomm's TCP "
                                             "links, plain, with a token, encrypted.")
    ap.add_argument("--nbytes", type=int, default=nbytes,
                    help=f"Bytes per message (default {nbytes}: the 4-bit payload of 1M "
                         "floats).")
    ap.add_argument("--rounds", type=int, default=100, help="Timed rounds per kind and rep "
                                                            "(default 100).")
    ap.add_argument("--reps", type=int, default=1, help="Times the kinds run in turn "
                                                        "(default 1).")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"Comma-separated, the first the baseline (default: all, "
                         f"{', '.join(KINDS)}).")
    ap.add_argument("--link", action="append", default=None, metavar="RATE[:DELAY_MS]",
                    help="An emulated link, e.g. 100mbit or 100mbit:50 (50 ms more each "
                         "way); repeat for more. Root only. Default: loopback.")
    ap.add_argument("--member", type=int, default=None,
                    help="Run one member's part (0 or 1), as this script starts them itself.")
    ap.add_argument("--rendezvous", default=None,
                    help="With --member: HOST:PORT of the rendezvous (member 0 serves it).")
    ap.add_argument("--host", default=None,
                    help="With --member: the address this member accepts its links on.")
    ap.add_argument("--relay", default=None,
                    help="With --member 0: HOST:PORT of the relay the rendezvous names.")
    a = ap.parse_args()
    if a.rounds < 4 or a.nbytes < 2 or a.reps < 1:
        ap.error(f"--rounds must be >= 4, --nbytes >= 2 and --reps >= 1, got {a.rounds}, "
                 f"{a.nbytes} and {a.reps}")
    kinds = a.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        ap.error(f"--kinds must name kinds among {', '.join(KINDS)}, got {unknown}")
    if a.member is not None:
        res = member_main(a.member, a.rendezvous, a.host, kinds, a.nbytes, a.rounds, a.reps,
                          a.relay)
        if res is not None:
            print("RESULT " + json.dumps(res), flush=True)
        return
    for link in a.link or [None]:
        where = "loopback" if link is None else f"emulated link {link} (RATE[:ms each way])"
        print(f"torch {torch.__version__}, 2 processes over {where}, {a.nbytes:,} bytes per "
              f"message, {a.rounds} rounds x {a.reps} reps per kind, interleaved; median ms "
              "per round [range of the reps' medians], ratio, bytes on the wire per message "
              "(sender's interface), CPU per payload byte (member 0)", flush=True)
        res = measure(link, kinds, a.nbytes, a.rounds, a.reps)
        print("\n".join(summary(res, a.nbytes)), flush=True)


if __name__ == "__main__":
    main()
