"""The rendezvous of a job: a small process of its own, so that it outlives every node.

    python -m qcomm.rendezvous --host 0.0.0.0 --port 29400 --nodes 3

It is torch's ``TCPStore`` server and nothing else (no consensus of its own): the nodes take
their seats and build their process groups through it (:mod:`.seat`). It holds the job's size
under ``qcomm/nodes``. With a job token (``QCOMM_TOKEN``) the store listens on localhost only
and the public port is the front of :mod:`.gate`: only the token's holders get in, encrypted.
With ``relay_port`` (``--relay-port``) it also runs the relay of the links whose two ends
both accept nothing (:mod:`.link_relay`), its address in the store under ``qcomm/relay``.
Stopping it (SIGTERM, SIGINT) does not stop nodes that are running: they need it only while
they start (and, for their relayed links, its relay).
"""

from __future__ import annotations

import datetime
import signal
import socket
import threading

import torch.distributed as dist

from qcomm.validation import check_host_port, check_int
from qcomm.wire.token import job_token

from .gate import Gate
from .link_relay import RELAY_KEY, LinkRelay

__all__ = ["MAX_NODES_KEY", "NODES_KEY", "serve"]

NODES_KEY = "qcomm/nodes"  # the number of nodes the job starts with
MAX_NODES_KEY = "qcomm/max_nodes"  # ... and may grow to (nodes linked through it only)


def _start_relay(host: str, relay_port: int, advertise: str | None, secret: bytes | None,
                 store: dist.Store, gate: Gate | None) -> LinkRelay:
    """The relay of links (:mod:`.link_relay`) on ``host:relay_port``, its address for the
    nodes published in ``store``. Raises RuntimeError when its port is taken (the gate
    closed)."""
    try:
        relay = LinkRelay(host, relay_port, secret)
    except OSError as e:
        if gate is not None:
            gate.close()
        raise RuntimeError(f"the relay cannot listen on {host}:{relay_port}: {e}") from e
    shown = host if host not in ("0.0.0.0", "::") else socket.gethostbyname(
        socket.gethostname())
    advertise = advertise or (f"[{shown}]:{relay_port}" if ":" in shown
                              else f"{shown}:{relay_port}")
    store.set(RELAY_KEY, advertise)
    return relay


def _check_can_listen(host: str, port: int) -> None:
    """Raise at once where ``host:port`` cannot be listened on: a name that does not resolve,
    an address of another machine, a port taken. TCPStore's own test of its address is its
    client's connect, retried for its whole timeout (a typo in ``host`` took 54 s to fail)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would
            probe.bind(address)
    except OSError as e:
        raise RuntimeError(f"the rendezvous cannot listen on {host}:{port}: {e}") from e


def serve(host: str, port: int, nodes: int, *, max_nodes: int | None = None,
          ready: threading.Event | None = None, stop: threading.Event | None = None,
          token: str | None = None, relay_port: int | None = None,
          relay_advertise: str | None = None) -> None:
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
        relay_port: TCP port, 1..65535, of the relay of the links whose two ends both accept
            nothing (:mod:`.link_relay`; on ``host``, admitting the token's holders); None:
            no relay.
        relay_advertise: ``"HOST:PORT"`` the nodes dial to reach the relay, when it is not
            ``host:relay_port`` (a forwarded port; a wildcard host: this machine's address).

    Raises:
        ValueError: a bad argument, named; RuntimeError: the port is taken.
    """
    port = check_int("port", port, low=1, high=65535)
    nodes = check_int("nodes", nodes, low=1)
    max_nodes = check_int("max_nodes", nodes if max_nodes is None else max_nodes, low=nodes,
                          what=f"an int >= nodes ({nodes})")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    relay_port = check_int("relay_port", relay_port, low=1, high=65535, allow_none=True)
    if relay_advertise is not None:
        check_host_port("relay_advertise", relay_advertise, "the address the nodes dial to "
                        "reach the relay")
        if relay_port is None:
            raise ValueError("relay_advertise needs relay_port: there is no relay without it")
    if relay_port == port:
        raise ValueError(f"relay_port must differ from the rendezvous's port ({port}), "
                         f"got {relay_port}")
    secret = job_token(token)
    _check_can_listen(host, port)
    try:
        # With a token, the store is reachable from this machine only; the gate is the port.
        store = dist.TCPStore("127.0.0.1" if secret else host, 0 if secret else port,
                              is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
        gate = Gate(host, port, store.port, secret) if secret else None
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"the rendezvous cannot listen on {host}:{port}: {e}") from e
    relay = None if relay_port is None else _start_relay(host, relay_port, relay_advertise,
                                                         secret, store, gate)
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
    if relay is not None:
        print(f"qcomm rendezvous: relaying the links whose two ends both accept nothing on "
              f"{host}:{relay_port} (the nodes dial {store.get(RELAY_KEY).decode()})",
              flush=True)
    if ready is not None:
        ready.set()
    while not stop.wait(0.5):
        pass
    if gate is not None:
        gate.close()
    if relay is not None:
        relay.close()
    del store
