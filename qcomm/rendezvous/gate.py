"""The rendezvous's public port when the job has a token: only the token's holders get in, and
what they say to the store is encrypted (:class:`Gate`).

torch's ``TCPStore`` admits whoever reaches its port and speaks in clear, and it has no hook to
change that. So with a token the store listens on localhost only, and the public port is this
front: each connection is admitted by the job token's challenge and response (the links' own,
:mod:`qcomm.wire.admission`, with the hello ``{"link": "rendezvous"}``), keyed
by it (:mod:`qcomm.wire.aead`), and relayed to the store (:mod:`.relay`). A node
reaches it through its local forwarder (:mod:`.tunnel`). A refused connection never reaches the
store: it takes no seat and reads no key. The first refusal from each address is logged, with
why (never the token); later ones from it are only counted.
"""

from __future__ import annotations

import socket
import sys
import threading

from qcomm.wire.admission import HANDSHAKE_TIMEOUT_S, AdmissionError, accept, cut
from qcomm.wire.aead import link_keys
from qcomm.wire.frames import FrameError

from .admitting import AdmittingServer
from .relay import relay

__all__ = ["HELLO", "Gate"]

# What a node's forwarder says it is: the one hello the gate admits.
HELLO = {"link": "rendezvous"}


def _say(line: str) -> None:
    print(f"qcomm rendezvous: {line}", file=sys.stderr, flush=True)


class Gate(AdmittingServer):
    """Serves ``host:port`` for the store at ``127.0.0.1:store_port`` (module docstring).

    Args:
        host, port: the public address (port 0: the system picks; :attr:`port` says which).
        store_port: the localhost port of the ``TCPStore`` served.
        token: the job token (bytes, at least 16).

    Attributes:
        refused: connections refused so far; tampered: connections ended by a frame that
        failed its authentication.
    """

    def __init__(self, host: str, port: int, store_port: int, token: bytes) -> None:
        self.token, self.store_port = token, store_port
        self.refused = self.tampered = 0
        super().__init__(host, port, "qcomm-gate")

    def _once(self, peer: str, line: str) -> None:
        """Log ``line`` if it is the first about ``peer``'s address."""
        if self._first_from(peer):
            _say(f"{line} (later ones from {peer} are not logged)")

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        # A read waits through socket timeouts (frames.recv_exact): the deadline of a handshake
        # is this timer, which cuts a connection that has not finished by then.
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut, args=(conn,))
        deadline.start()
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                admitted = accept(conn, self.token)
                if admitted.hello != HELLO:
                    raise AdmissionError(f"not a rendezvous connection (hello "
                                         f"{admitted.hello})")
            except AdmissionError as e:
                conn.close()
                with self._lock:
                    self.refused += 1
                self._once(peer[0], f"refused a connection from {peer[0]}:{peer[1]}: {e} "
                                    "(no seat taken, nothing read from the store)")
                return
            except (FrameError, OSError) as e:
                # It closed or said nothing during the handshake: a port scan, or a process
                # that speaks no qcomm (e.g. a TCPStore client without the token).
                conn.close()
                with self._lock:
                    self.refused += 1
                self._once(peer[0], f"refused a connection from {peer[0]}:{peer[1]}: no job "
                                    f"token's handshake ({e}); nodes of this job need "
                                    "QCOMM_TOKEN")
                return
        finally:
            deadline.cancel()
            self._handshake_over()
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port))
        except OSError:
            conn.close()
            return
        conn.settimeout(None)
        for s in (conn, store):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sealer, opener = link_keys(self.token, admitted, dialler=False)
        relay(store, conn, sealer, opener, lambda why: self._ended(peer, why))

    def _ended(self, peer: tuple, why: str | None) -> None:
        if why is None:
            return
        with self._lock:
            self.tampered += 1
        _say(f"ended the connection from {peer[0]}:{peer[1]}: {why}")
