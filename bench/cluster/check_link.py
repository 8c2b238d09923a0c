"""Is the emulated link what it claims? Round-trip time and bulk TCP rate between two nodes.

For every (delay, rate) asked for, this builds a 2-node cluster with ``netns.sh up --delay-ms D
--rate R`` (the delayline forwarder; ``--delays bridge`` builds the plain bridge instead, which
has no latency), then from node 0 to node 1:

* RTT: 50 UDP echoes of 64 bytes, one at a time; the median should be 2 D (plus well under a
  millisecond of forwarding);
* rate: one TCP stream sends ``--bulk-mb`` MiB as fast as it can; the receiver counts the bytes
  of payload per second between its first and last byte, and over the second half of them
  alone (the rate sustained once slow start is over, which takes about a second at a 100 ms
  round trip). It should be the link rate minus TCP/IP headers (about 96% of the rate at MTU
  1500, 99.9% at MTU 65000), also when the round trip is long: the namespaces allow 32 MB TCP
  windows.

Needs root. Prints a table and writes JSON (``--out``).

    sudo python bench/cluster/check_link.py --delays bridge,0,10,50 --rates 100mbit,1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NETNS = HERE / "netns.sh"
PORT = 47001


def _ns(cluster: str, node: int) -> str:
    return f"qcb{cluster}n{node}"


def _in_ns(cluster: str, node: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", _ns(cluster, node), sys.executable,
                             __file__, *args], stdout=subprocess.PIPE, text=True)


# ---------------------------------------------------------------------------------------------
# the two ends (run inside the namespaces by the driver below)


def serve(count: int, nbytes: int) -> None:
    """Node 1: echo ``count`` UDP datagrams, then receive one TCP stream of ``nbytes``."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("10.77.0.2", PORT))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("10.77.0.2", PORT))
    tcp.listen(1)
    print("listening", flush=True)
    for _ in range(count):
        data, addr = udp.recvfrom(2048)
        udp.sendto(data, addr)
    conn, _ = tcp.accept()
    got, first, last, half = 0, None, None, None
    buf = bytearray(1 << 20)
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        now = time.monotonic()
        first = first or now
        last = now
        got += n
        if half is None and got >= nbytes // 2:
            half = (now, got)
    conn.sendall(b"k")
    conn.close()
    # The second half alone: the rate the link sustains once TCP's slow start is over.
    print(json.dumps({"bytes": got, "seconds": (last - first) if first else None,
                      "second_half": [last - half[0], got - half[1]] if half else None}),
          flush=True)


def probe(count: int, nbytes: int) -> None:
    """Node 0: time ``count`` UDP echoes, then send ``nbytes`` over one TCP stream."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(5.0)
    rtts = []
    for i in range(count):
        t = time.monotonic()
        udp.sendto(i.to_bytes(4, "little") * 16, ("10.77.0.2", PORT))
        udp.recvfrom(2048)
        rtts.append(time.monotonic() - t)
        time.sleep(0.01)
    tcp = socket.create_connection(("10.77.0.2", PORT), timeout=120)
    chunk = b"\0" * (1 << 20)
    t = time.monotonic()
    sent = 0
    while sent < nbytes:
        tcp.sendall(chunk[: min(len(chunk), nbytes - sent)])
        sent += min(len(chunk), nbytes - sent)
    tcp.recv(1)
    print(json.dumps({"rtt_ms": [1e3 * r for r in rtts], "send_s": time.monotonic() - t}),
          flush=True)


# ---------------------------------------------------------------------------------------------
# the driver


def rate_bits(rate: str) -> float:
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


def measure(delay: str, rate: str, count: int, bulk_mb: float) -> dict:
    cluster = secrets.token_hex(3)
    up = ["bash", str(NETNS), "up", "--id", cluster, "--nodes", "2", "--rate", rate,
          "--owner", str(os.getpid())]
    if delay != "bridge":
        up += ["--delay-ms", delay]
    nbytes = int(bulk_mb * (1 << 20))
    try:
        subprocess.run(up, check=True)
        server = _in_ns(cluster, 1, "--serve", str(count), str(nbytes))
        assert server.stdout is not None
        server.stdout.readline()  # listening
        client = _in_ns(cluster, 0, "--probe", str(count), str(nbytes))
        c_out, _ = client.communicate(timeout=600)
        s_out, _ = server.communicate(timeout=60)
    finally:
        subprocess.run(["bash", str(NETNS), "down", "--id", cluster], check=False)
    c, s = json.loads(c_out.strip().splitlines()[-1]), json.loads(s_out.strip().splitlines()[-1])
    rtt = statistics.median(c["rtt_ms"])
    payload_bps = 8 * s["bytes"] / s["seconds"]
    sustained_bps = 8 * s["second_half"][1] / s["second_half"][0]
    d = None if delay == "bridge" else float(delay)
    return {"delay_ms": d, "link": "bridge" if d is None else "delayline", "rate": rate,
            "rtt_median_ms": rtt, "rtt_min_ms": min(c["rtt_ms"]), "rtt_max_ms": max(c["rtt_ms"]),
            "rtt_vs_2d": None if not d else rtt / (2 * d),
            "tcp_payload_bits_per_s": payload_bps,
            "tcp_vs_rate": payload_bps / rate_bits(rate),
            "tcp_sustained_bits_per_s": sustained_bps,
            "tcp_sustained_vs_rate": sustained_bps / rate_bits(rate), "bulk_bytes": s["bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--delays", default="bridge,0,10,50",
                   help="Comma-separated one-way delays in ms through the delayline forwarder; "
                        "'bridge' measures the plain bridge (no forwarder, no latency).")
    p.add_argument("--rates", default="100mbit,1gbit",
                   help="Comma-separated link rates (tc syntax: 100mbit, 1gbit).")
    p.add_argument("--count", type=int, default=50, help="UDP echoes per cell.")
    p.add_argument("--bulk-mb", type=float, default=0.0,
                   help="MiB the TCP stream sends; 0: about 4 s at the link rate (at least "
                        "8 MiB).")
    p.add_argument("--out", default="", help="JSON file to write.")
    p.add_argument("--serve", nargs=2, type=int, metavar=("COUNT", "BYTES"),
                   help="Run node 1's end (the driver starts it inside the namespace): echo "
                        "COUNT datagrams, then receive BYTES over TCP.")
    p.add_argument("--probe", nargs=2, type=int, metavar=("COUNT", "BYTES"),
                   help="Run node 0's end (the driver starts it inside the namespace): time "
                        "COUNT echoes, then send BYTES over TCP.")
    args = p.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    if args.probe:
        probe(*args.probe)
        return 0
    if os.geteuid() != 0:
        print("check_link.py: needs root (network namespaces)", file=sys.stderr)
        return 1
    rows = []
    for rate in args.rates.split(","):
        for delay in args.delays.split(","):
            mb = args.bulk_mb or max(8.0, 4 * rate_bits(rate) / 8 / (1 << 20))
            rows.append(measure(delay.strip(), rate.strip(), args.count, mb))
            r = rows[-1]
            print(f"{r['link']:<9} delay {r['delay_ms'] if r['delay_ms'] is not None else '-':>4} "
                  f"ms  {rate:>7}: RTT median {r['rtt_median_ms']:7.2f} ms [min "
                  f"{r['rtt_min_ms']:.2f}, max {r['rtt_max_ms']:.2f}]"
                  + (f" = {r['rtt_vs_2d']:.3f} x 2D" if r["rtt_vs_2d"] else "")
                  + f"; TCP {r['tcp_payload_bits_per_s'] / 1e6:7.1f} Mbit/s = "
                  f"{100 * r['tcp_vs_rate']:.1f}% of the rate (second half "
                  f"{100 * r['tcp_sustained_vs_rate']:.1f}%)", flush=True)
    env = {"cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"],
                                 capture_output=True, text=True).stdout.strip(),
           "loadavg": os.getloadavg()}
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
