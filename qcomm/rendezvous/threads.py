"""torch's threads when several nodes of a job share one machine.

torch starts as many intra-op threads as the machine has cores. torchrun of several processes
sets ``OMP_NUM_THREADS=1`` for them, but a torchrun of one process leaves it unset, so nodes
emulated on one machine, each its own ``torchrun --nproc-per-node 1``, run a core count of
threads each and oversubscribe the cores. Each node tells the rendezvous its host when it
takes its seat; a process that finds other nodes' processes on its host, with
``OMP_NUM_THREADS`` unset, takes its share of the cores (cores // processes on the host) and
says so once, with the way to choose otherwise. ``OMP_NUM_THREADS`` set by the user is left
alone, as torchrun leaves it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from qcomm.validation import check_int

__all__ = ["fit_threads", "host_share", "register_host", "threads_for"]

log = logging.getLogger("qcomm")

_HOST_KEY = "qcomm/host/{node}"   # "<hostname>:<procs_per_node>" of the node in that seat
_warned = False                   # the advice is given once per process


def register_host(store: dist.Store, node: int, procs_per_node: int,
                  host: str | None = None) -> None:
    """Record at the rendezvous that ``node`` runs ``procs_per_node`` processes on ``host``
    (default: this machine's name). Keyed by seat: a node that comes back replaces its
    entry."""
    host = socket.gethostname() if host is None else host
    store.set(_HOST_KEY.format(node=node), f"{host}:{procs_per_node}")


def host_share(store: dist.Store, nodes: int, host: str | None = None
               ) -> tuple[int, list[int]]:
    """The processes of the job's nodes seated on ``host`` so far (default: this machine), and
    those nodes, from the seats ``0 .. nodes - 1`` (each node counted once, seats not taken yet
    not at all)."""
    host = socket.gethostname() if host is None else host
    processes, here = 0, []
    for node in range(nodes):
        key = _HOST_KEY.format(node=node)
        if not store.check([key]):
            continue
        name, _, ppn = store.get(key).decode().rpartition(":")
        if name == host:
            processes += int(ppn)
            here.append(node)
    return processes, here


def threads_for(cores: int, processes: int, env: Mapping[str, str] | None = None) -> int | None:
    """torch's threads per process for ``processes`` of this job on a machine of ``cores``
    cores: their share of the cores (at least 1); None when nothing is to change: one process
    on the machine, or ``OMP_NUM_THREADS`` set (the user's choice, ``env`` default
    ``os.environ``).

    Raises:
        ValueError: ``cores`` or ``processes`` below 1, named.
    """
    cores = check_int("cores", cores, low=1)
    processes = check_int("processes", processes, low=1)
    env = os.environ if env is None else env
    if processes == 1 or env.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores // processes)


def _cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a container sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def fit_threads(store: dist.Store, nodes: int, node: int) -> int | None:
    """Share this machine's cores among the job's processes on it (module docstring): sets
    torch's intra-op threads to :func:`threads_for` when that lowers them, warning once.
    Returns the threads set, else None."""
    global _warned
    processes, here = host_share(store, nodes)
    threads = threads_for(_cores(), processes)
    if threads is None or threads >= torch.get_num_threads():
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if not _warned:
        _warned = True
        earlier = [n for n in here if n < node]
        log.warning(
            "qcomm: nodes %s of this job share this machine (%s), %d processes on %d cores: "
            "torch's threads set from %d to %d per process so that they do not oversubscribe "
            "the cores (OMP_NUM_THREADS is unset; set it on every node of this machine to "
            "choose, e.g. OMP_NUM_THREADS=%d)%s", here, socket.gethostname(), processes,
            _cores(), before, threads, threads,
            f"; nodes {earlier}, seated before, may still run more" if earlier else "")
    return threads
