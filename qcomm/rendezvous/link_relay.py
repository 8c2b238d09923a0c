"""A relay for the socket links whose two ends both accept nothing (both behind a NAT): one
port, on the rendezvous's machine (``--relay-port``), that both ends dial, naming their link;
the relay pairs the two connections by that name and splices their bytes both ways
(:class:`LinkRelay`).

Each connection is first admitted with the job token's challenge and response
(:mod:`qcomm.wire.admission`, the relay as the accepting end), so a stray holds no place; its
hello names the link (``"pair"``) and the end it plays there (``"side"``: ``"dial"`` or
``"accept"``). Once the two ends of a link are here the relay says so (``P``) to both and from
then on carries bytes and nothing else: the link's own handshake and its encryption run end to
end between the two nodes through it (the relay reads only sealed frames; it holds the token
but not the link's keys, which come from nonces the two ends exchange, and any byte it changed
fails the frame's authentication). A connection whose other end does not come within
``wait_s``, one beyond ``max_waiting`` waiting, or a third one for a link, is refused with why
(``N``, then the reason) and closed; one that closed while it waited is dropped when the
next one for its link comes. When one side of a splice closes, both close.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import sys
import threading

from qcomm.wire.admission import HANDSHAKE_TIMEOUT_S, AdmissionError, accept, cut
from qcomm.wire.frames import FrameError

from .admitting import AdmittingServer

__all__ = ["PAIRED", "RELAY_KEY", "RELAY_LINK", "LinkRelay"]

# Where the rendezvous publishes the relay's address ("HOST:PORT") in its store.
RELAY_KEY = "qcomm/relay"
# The hello's "link" of a connection to the relay (its "pair" names the link relayed).
RELAY_LINK = "relay"
# What the relay answers once both ends of a link are here (else b"N", a length, why).
PAIRED = b"P"
_CHUNK = 1 << 16


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


class _Waiting:
    """A connection admitted for a link whose other end has not come yet."""

    def __init__(self, conn: socket.socket, side: str) -> None:
        self.conn, self.side = conn, side
        self.partner: socket.socket | None = None
        self.dropped = False   # it closed before its other end came: a newer one took its place
        self.event = threading.Event()

    def gone(self) -> bool:
        """Whether this end closed while it waited (it sends nothing before it is paired)."""
        try:
            # (a socket with a timeout would wait it out in recv: ask select whether to read)
            if not select.select([self.conn], [], [], 0)[0]:
                return False   # open, silent: as it should be
            return self.conn.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class LinkRelay(AdmittingServer):
    """Pairs and splices the connections of links relayed through ``host:port`` (module
    docstring).

    Args:
        host, port: where to listen (port 0: the system picks; :attr:`port` says which).
        token: the job token each connection must prove it holds (None: anyone).
        wait_s: how long a connection waits for its link's other end.
        max_waiting: connections waiting for their other end at once, at most.

    Attributes:
        port: the port bound. refused: connections refused so far. spliced: links spliced so
        far.
    """

    def __init__(self, host: str, port: int, token: bytes | None, *, wait_s: float = 120.0,
                 max_waiting: int = 256) -> None:
        self.token, self.wait_s, self.max_waiting = token, wait_s, max_waiting
        self.refused = self.spliced = 0
        self._waiting: dict[str, _Waiting] = {}
        self._busy: set[str] = set()   # links spliced now: a third connection is refused
        super().__init__(host, port, "qcomm-relay")

    def _refuse(self, conn: socket.socket, peer: tuple, why: str) -> None:
        with self._lock:   # counted before the refused end hears it
            self.refused += 1
        first = self._first_from(peer[0])
        with contextlib.suppress(OSError):
            reason = why.encode()
            conn.sendall(b"N" + struct.pack("!H", len(reason)) + reason)
        _close(conn)
        if first:
            print(f"qcomm rendezvous: relay refused a connection from {peer[0]}:{peer[1]}: "
                  f"{why} (later ones from {peer[0]} are not logged)", file=sys.stderr,
                  flush=True)

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        # A read waits through socket timeouts (frames.recv_exact): this timer is the
        # handshake's deadline, cutting a connection that says nothing.
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut, args=(conn,))
        deadline.start()
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = accept(conn, self.token).hello
            except AdmissionError as e:
                return self._refuse(conn, peer, str(e))
            except (FrameError, OSError) as e:
                return self._refuse(conn, peer, f"no job token's handshake ({e})")
        finally:
            deadline.cancel()
            self._handshake_over()
        link, side = hello.get("pair"), hello.get("side")
        if hello.get("link") != RELAY_LINK or not isinstance(link, str) or \
                side not in ("dial", "accept"):
            return self._refuse(conn, peer, f"not a relayed link's hello ({hello})")
        self._pair(conn, peer, link, side)

    def _pair(self, conn: socket.socket, peer: tuple, link: str, side: str) -> None:
        with self._lock:
            other = self._waiting.get(link)
            if other is not None and other.gone():
                # An end that gave up waiting (its link's timeout) and closed: this one, a
                # newer try of the same end or the other end, waits in its place.
                del self._waiting[link]
                other.dropped = True
                other.event.set()
                other = None
            why = (f"link {link} is relayed already" if link in self._busy else
                   f"both ends of link {link} say they {side}" if other and other.side == side
                   else f"{self.max_waiting} connections wait already"
                   if other is None and len(self._waiting) >= self.max_waiting else None)
            if why is None and other is not None:
                del self._waiting[link]
                self._busy.add(link)
                self.spliced += 1
                other.partner = conn
                other.event.set()
            elif why is None:
                mine = self._waiting[link] = _Waiting(conn, side)
        if why is not None:
            return self._refuse(conn, peer, why)
        if other is not None:
            return self._splice(link, other.conn, conn)
        if mine.event.wait(self.wait_s):
            if mine.dropped:
                _close(conn)
            return   # else the other end's thread splices
        with self._lock:
            if mine.partner is None:   # still alone (else paired just now: it splices)
                self._waiting.pop(link, None)
                why = f"the other end of link {link} did not come within {self.wait_s:g} s"
        if mine.partner is None:
            self._refuse(conn, peer, why)

    def _splice(self, link: str, a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            s.settimeout(None)
        try:
            for s in (a, b):
                s.sendall(PAIRED)
        except OSError:
            return self._ended(link, a, b)
        lock, done = threading.Lock(), [0]

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while chunk := src.recv(_CHUNK):
                    dst.sendall(self._carry(chunk, src))
            except OSError:
                pass   # a side broke: both end
            _close(a, b)   # one side closed: the link is over, both close
            with lock:
                done[0] += 1
                last = done[0] == 2
            if last:
                self._ended(link, a, b)

        threading.Thread(target=pipe, args=(a, b), daemon=True, name="qcomm-relay-pipe").start()
        pipe(b, a)

    def _carry(self, chunk: bytes, src: socket.socket) -> bytes:
        """The bytes passed on for ``chunk``, read from ``src``: the bytes as read (a test's
        relay looks at them, or changes one)."""
        return chunk

    def _ended(self, link: str, *socks: socket.socket) -> None:
        _close(*socks)
        with self._lock:
            self._busy.discard(link)
