"""A node's one inbound port: every socket link that this process accepts arrives on it and is
routed, by the link its hello names, to the link that waits for it (:class:`Listener`).

One listener per address per process (:func:`listener_at`): the groups of a process (and the
incarnations of a member that comes and goes in one process) share it. Each connection is
admitted on a thread of its own (:func:`.admission.accept`, bounded by
:data:`~.admission.HANDSHAKE_TIMEOUT_S`), so a process that connects and says nothing holds up
no other; at most :data:`MAX_ADMITTING` at once (more are closed unread: a flood costs no
threads). A refused connection takes no link; the first one from each address is logged here
with why (never the token), later ones from it are only counted. An admitted connection no
link claims within ``park_s`` is closed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from qcomm.rendezvous.waiting import raise_if_abandoned
from qcomm.validation import check_host_port
from qcomm.wire.admission import HANDSHAKE_TIMEOUT_S, AdmissionError, Admitted, accept, cut
from qcomm.wire.frames import FrameError

__all__ = ["Listener", "connect_to", "listener_at", "parse_listen"]

log = logging.getLogger(__name__)

# Handshakes in progress at once, at most (each holds a thread up to HANDSHAKE_TIMEOUT_S).
MAX_ADMITTING = 64
# Seconds between a link's looks, while it waits for its other end (here, or at the relay),
# at whether its wait was abandoned.
CLAIM_POLL_S = 0.05


def parse_listen(address: object, name: str = "listen") -> tuple[str, int]:
    """``"HOST:PORT"`` (PORT 0: the system picks one) as (host, port).

    Raises:
        ValueError: not of that form, naming ``name``.
    """
    return check_host_port(name, address, "the address this node accepts its links on "
                           "(QCOMM_LISTEN)", low_port=0)


class Listener:
    """Accepts links on ``host:port`` (module docstring).

    Args:
        host, port: where to listen (port 0: the system picks; :attr:`address` says which).
        token: the job token every dialler must prove it holds (None: anyone is admitted).
        park_s: how long an admitted connection waits for its link to claim it.

    Attributes:
        address: ``"HOST:PORT"`` the peers dial: the host given, or this machine's address
            when it is a wildcard (``0.0.0.0``, ``::``).
        refused: connections refused so far.
    """

    def __init__(self, host: str, port: int, token: bytes | None, park_s: float = 300.0
                 ) -> None:
        self.token = token
        self.park_s = park_s
        self.sock = socket.create_server((host, port), backlog=64,
                                         family=socket.AF_INET6 if ":" in host
                                         else socket.AF_INET)
        self.sock.settimeout(1.0)   # the accept loop looks up when closed
        bound = self.sock.getsockname()[1]
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostbyname(
            socket.gethostname())
        self.address = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"
        self.refused = 0
        self._refused_from: set[str] = set()   # addresses whose refusal was logged
        self._admitting = threading.BoundedSemaphore(MAX_ADMITTING)
        self.cond = threading.Condition()
        self._parked: dict[str, tuple[socket.socket, Admitted, float]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"qcomm-listen-{bound}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return   # closed
            if not self._admitting.acquire(blocking=False):
                conn.close()   # too many handshakes at once: a flood, not the job
                continue
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True,
                             name="qcomm-admit").start()

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        try:
            self._handshake(conn, peer)
        finally:
            self._admitting.release()

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A read waits through socket timeouts (frames.recv_exact): the handshake's deadline is
        # this timer, which cuts a connection that says nothing (else it held its thread and
        # one of MAX_ADMITTING places for good).
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut, args=(conn,))
        deadline.start()
        try:
            admitted = accept(conn, self.token)
        except (AdmissionError, FrameError, OSError) as e:
            conn.close()
            if isinstance(e, AdmissionError):
                with self.cond:
                    self.refused += 1
                    first = peer[0] not in self._refused_from
                    self._refused_from.add(peer[0])
                if first:
                    log.warning("refused a connection from %s:%s on %s: %s (no link taken; "
                                "later refusals from %s are not logged)", peer[0], peer[1],
                                self.address, e, peer[0])
            return
        finally:
            deadline.cancel()
        key = admitted.hello["link"]
        now = time.monotonic()
        with self.cond:
            stale = [k for k, (_, _, t) in self._parked.items() if now - t > self.park_s]
            old = [self._parked.pop(k)[0] for k in stale]
            if key in self._parked:   # the same link dialled again: the newer one counts
                old.append(self._parked.pop(key)[0])
            self._parked[key] = (conn, admitted, now)
            self.cond.notify_all()
        for c in old:
            c.close()

    def claim(self, link: str, timeout_s: float) -> tuple[socket.socket, Admitted]:
        """The connection admitted for ``link``, waiting for it up to ``timeout_s``. The wait
        ends early when the calling thread's wait is abandoned
        (:func:`~qcomm.rendezvous.waiting.abandon_when`: its link's streams closed while the
        other end never came) or the listener closes.

        Raises:
            TimeoutError: it did not come within ``timeout_s``;
            WaitAbandoned: the wait was abandoned (a RuntimeError);
            RuntimeError: the listener closed.
        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while link not in self._parked:
                # In slices: a daemon thread still waiting here when the interpreter exits
                # outlives its streams' close() by up to the bound (minutes) otherwise.
                raise_if_abandoned()
                if self._closed:
                    raise RuntimeError(f"link {link}: the listener on {self.address} closed "
                                       "while the link waited for its other end")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the other end of link {link} did not connect to "
                                       f"{self.address} within {timeout_s:g} s")
                self.cond.wait(min(left, CLAIM_POLL_S))
            conn, admitted, _ = self._parked.pop(link)
        return conn, admitted

    def close(self) -> None:
        """Stop accepting; parked connections close, and claims waiting end."""
        self._closed = True
        self.sock.close()
        with self.cond:
            parked, self._parked = list(self._parked.values()), {}
            self.cond.notify_all()
        for conn, _, _ in parked:
            conn.close()


_listeners: dict[tuple[str, int, bytes | None], Listener] = {}
_lock = threading.Lock()


def listener_at(address: str, token: bytes | None) -> Listener:
    """This process's listener on ``address`` (``"HOST:PORT"``), started at the first call
    (with port 0: the first call with this token).

    Raises:
        ValueError: ``address`` is malformed, or the listener there admits with another token.
        OSError: the address cannot be bound (the port taken by another process, the host
            none of this machine's), naming it.
    """
    host, port = parse_listen(address)
    # Port 0 (the system picks) is one listener per token: they never meet on a port.
    key = (host, port, None if port else token)
    with _lock:
        listener = _listeners.get(key)
        if listener is None:
            try:
                listener = _listeners[key] = Listener(host, port, token)
            except OSError as e:   # the OS's words alone name neither the address nor why
                raise OSError(e.errno, f"cannot accept links on {address} (listen, "
                              f"QCOMM_LISTEN): {e.strerror}; it must be an address of this "
                              f"machine and a port no other process holds") from e
        elif listener.token != token:
            raise ValueError(f"this process listens on {address} already, with another job "
                             "token")
    return listener


def connect_to(address: str, what: str, timeout_s: float) -> socket.socket:
    """A TCP connection to ``address`` (``"HOST:PORT"``, ``what`` it is, for the errors),
    Nagle off (a link's messages are sent whole), its connect bounded by the handshake's
    deadline.

    Raises:
        ValueError: ``address`` is not ``HOST:PORT`` (named by ``what``);
        RuntimeError: the connection cannot be made, saying where.
    """
    host, port = parse_listen(address, what)
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout_s,
                                                                  HANDSHAKE_TIMEOUT_S))
    except OSError as e:
        raise RuntimeError(f"cannot connect to {what} at {address}: {e}") from e
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
