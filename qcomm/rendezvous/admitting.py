"""A TCP server that admits each connection on a thread of its own (:class:`AdmittingServer`):
what the rendezvous's front (:mod:`.gate`) and its relay of links (:mod:`.link_relay`) both
are.

At most :data:`MAX_ADMITTING` handshakes run at once; a connection beyond them is closed unread,
so a flood of connections costs no threads. Refusals are logged once per address
(:meth:`AdmittingServer._first_from`): a stray that retries does not flood the log.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["MAX_ADMITTING", "AdmittingServer"]

MAX_ADMITTING = 64


class AdmittingServer:
    """Listens on ``host:port`` (port 0: the system picks; :attr:`port` says which) and calls
    :meth:`_admit` on a thread per connection. A subclass sets its own attributes first, then
    calls this ``__init__`` (which starts accepting); its ``_admit`` calls
    :meth:`_handshake_over` once, when the connection's handshake ended either way."""

    def __init__(self, host: str, port: int, name: str) -> None:
        self.sock = socket.create_server((host, port), backlog=128,
                                         family=socket.AF_INET6 if ":" in host
                                         else socket.AF_INET)
        self.port = self.sock.getsockname()[1]
        self._name = name
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._admitting = threading.BoundedSemaphore(MAX_ADMITTING)
        threading.Thread(target=self._accept_loop, daemon=True, name=name).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return   # closed
            if not self._admitting.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True,
                             name=f"{self._name}-admit").start()

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError

    def _handshake_over(self) -> None:
        """A handshake ended: another may start."""
        self._admitting.release()

    def _first_from(self, address: str) -> bool:
        """Whether this is the first refusal logged for ``address`` (and count it as logged)."""
        with self._lock:
            first = address not in self._logged
            self._logged.add(address)
        return first

    def close(self) -> None:
        """Stop accepting (connections admitted so far go on until they close)."""
        self.sock.close()
