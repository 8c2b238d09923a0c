"""The rendezvous of a job: a small process of its own, so that it outlives every node.

    python -m qcomm.rendezvous --host 0.0.0.0 --port 29400 --nodes 3

It is torch's ``TCPStore`` server and nothing else (no consensus of its own): the nodes take
their seats and build their process groups through it (:mod:`.seat`). It holds the job's size
under ``qcomm/nodes``. With a job token (``QCOMM_TOKEN``) the store listens on localhost only
and the public port is the front of :mod:`.gate`: only the token's holders get in, encrypted.
Stopping it (SIGTERM, SIGINT) does not stop nodes that are running: they need it only while
they start.
"""

from __future__ import annotations

import datetime
import signal
import threading

import torch.distributed as dist

from qcomm.validation import check_int
from qcomm.wire.token import job_token

from .gate import Gate

__all__ = ["MAX_NODES_KEY", "NODES_KEY", "serve"]

NODES_KEY = "qcomm/nodes"  # the number of nodes the job starts with
MAX_NODES_KEY = "qcomm/max_nodes"  # ... and may grow to (nodes linked through it only)


def serve(host: str, port: int, nodes: int, *, max_nodes: int | None = None,
          ready: threading.Event | None = None, stop: threading.Event | None = None,
          token: str | None = None) -> None:
    """Serve the rendezvous of a job of ``nodes`` nodes on ``host:port`` until SIGTERM or
    SIGINT (or ``stop`` is set).

    Args:
        host: the address to listen on (``0.0.0.0``: every interface).
        port: TCP port, 1..65535.
        nodes: nodes the job starts with, >= 1.
        max_nodes: nodes it may grow to, >= nodes (None: ``nodes``): with nodes linked
            through the rendezvous (:func:`~qcomm.rendezvous.node.init_node`), a node that
            starts later takes a seat beyond ``nodes`` and joins the running job.
        ready: set once the store listens (for callers in the same process).
        stop: set it to stop serving (for callers in the same process; signals are handled
            only in the main thread).
        token: the job token (at least 16 characters); None reads ``QCOMM_TOKEN`` (unset:
            none, anyone who reaches the port is served, in clear).

    Raises:
        ValueError: a bad argument, named; RuntimeError: the port is taken.
    """
    port = check_int("port", port, low=1, high=65535)
    nodes = check_int("nodes", nodes, low=1)
    max_nodes = check_int("max_nodes", nodes if max_nodes is None else max_nodes, low=nodes,
                          what=f"an int >= nodes ({nodes})")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    secret = job_token(token)
    try:
        # With a token, the store is reachable from this machine only; the gate is the port.
        store = dist.TCPStore("127.0.0.1" if secret else host, 0 if secret else port,
                              is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        gate = Gate(host, port, store.port, secret) if secret else None
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"the rendezvous cannot listen on {host}:{port}: {e}") from e
    store.set(NODES_KEY, str(nodes))
    store.set(MAX_NODES_KEY, str(max_nodes))
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    grows = f" (up to {max_nodes})" if max_nodes > nodes else ""
    admits = (", admitting only the job token's holders, encrypted" if secret else
              ", admitting anyone who reaches it, in clear (no QCOMM_TOKEN)")
    print(f"qcomm rendezvous: listening on {host}:{port} for a job of {nodes} nodes{grows}"
          f"{admits}", flush=True)
    if ready is not None:
        ready.set()
    while not stop.wait(0.5):
        pass
    if gate is not None:
        gate.close()
    del store
