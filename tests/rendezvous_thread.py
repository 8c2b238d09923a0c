"""A rendezvous (:func:`qcomm.rendezvous.serve`) in a thread of the test's process, for the tests
whose members and joins talk to one without starting ``python -m qcomm.rendezvous``."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator

import torch.distributed as dist

from qcomm.rendezvous import serve
from qcomm.testing.multiprocess import free_port


def serve_in_thread(port: int, nodes: int = 3) -> tuple[threading.Thread, threading.Event]:
    """Serve a job of ``nodes`` on ``127.0.0.1:port`` from a daemon thread, ready on return:
    the thread and the event that stops it."""
    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=serve, args=("127.0.0.1", port, nodes),
                         kwargs={"ready": ready, "stop": stop}, daemon=True)
    t.start()
    assert ready.wait(10), "the rendezvous did not start within 10 s"
    return t, stop


@contextlib.contextmanager
def rendezvous_in_thread(nodes: int = 3, client_timeout_s: float = 5.0
                         ) -> Iterator[tuple[int, dist.Store]]:
    """A rendezvous on a free port for the block: its port and a client (``client_timeout_s``);
    stopped at the end."""
    port = free_port()
    t, stop = serve_in_thread(port, nodes)
    try:
        yield port, dist.TCPStore("127.0.0.1", port, is_master=False,
                                  timeout=datetime.timedelta(seconds=client_timeout_s))
    finally:
        stop.set()
        t.join(5)
