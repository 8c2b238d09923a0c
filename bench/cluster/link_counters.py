"""The byte counters of a cluster run's timed window: the node's interface (tx bytes, rx bytes,
tx packets) and its TCP retransmits, read from this network namespace's /proc, and the
method's own counters.

Imported by workload.py and wire_overheads.py.
"""

from __future__ import annotations

from pathlib import Path

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import training as T
from bench.cluster.rank_place import Place


def read_iface_bytes(iface: str) -> tuple[int, int, int]:
    """(tx_bytes, rx_bytes, tx_packets) of ``iface`` in this process's network namespace
    (/proc/net/dev is per namespace, unlike a /sys that may be mounted from another one)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[8]), int(fields[0]), int(fields[9])
    raise RuntimeError(f"interface {iface!r} not found in /proc/net/dev (set QCB_IFACE)")


def read_tcp_retransmits() -> int:
    """TCP segments retransmitted so far by this network namespace (/proc/net/snmp is per
    namespace): resent bytes count in tx_bytes but in no algorithm's formula."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


# The byte counters read when the window opens (and again when it closes): the node's
# interface (tx bytes, rx bytes, tx packets) and TCP retransmits, read by the node's local
# rank 0 when there are other nodes (else None), and the method's own counters (or None).
Readings = tuple[tuple[int, int, int] | None, int | None, dict[str, int] | None]


def read_counters(here: Place, built: T.Built, node_counters: bool) -> Readings:
    """The byte counters (:data:`Readings`); the node's only when ``node_counters``."""
    counters = read_iface_bytes(here.iface) if node_counters else None
    retrans = read_tcp_retransmits() if counters is not None else None
    return counters, retrans, built.comm_stats()


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/link_counters.py is a library of the cluster benchmark "
        "(the byte counters a run reads), imported by workload.py and wire_overheads.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
