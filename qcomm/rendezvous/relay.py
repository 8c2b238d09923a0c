"""Bytes carried between a plain connection and a sealed one: what the rendezvous's front
(:mod:`.gate`) and a node's local forwarder (:mod:`.tunnel`) both run, one relay per TCPStore
connection.

The plain side is torch's ``TCPStore`` protocol on localhost, read in chunks as they come; the
sealed side carries each chunk as one frame (:mod:`qcomm.wire.frames`), encrypted
and authenticated (:mod:`qcomm.wire.aead`). A frame that fails its
authentication ends the relay, both connections closed, and says so: a changed byte never
reaches the store.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from qcomm.wire.frames import FrameError, Opener, Sealer, recv_frame, send_frame

__all__ = ["CHUNK", "relay"]

# The most bytes read from the plain side at once (one frame each): a TCPStore message is
# small; a joiner's state goes in parts of a few MB, carried in chunks of this size.
CHUNK = 1 << 16


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def relay(plain: socket.socket, sealed: socket.socket, sealer: Sealer, opener: Opener,
          on_end: Callable[[str | None], None] | None = None) -> None:
    """Carry bytes both ways between ``plain`` and ``sealed`` (connected sockets, blocking) on
    two daemon threads, until either side closes or breaks; then both close.

    ``on_end`` is called once, with None when a side closed in order, else why the sealed side
    ended (e.g. a frame that failed its authentication).
    """
    lock = threading.Lock()
    ended = [False]

    def end(why: str | None) -> None:
        with lock:
            if ended[0]:
                return
            ended[0] = True
        # said before the sockets close: whoever sees the connection end can read why
        if on_end is not None:
            on_end(why)
        _close(plain, sealed)

    def outward() -> None:
        try:
            while chunk := plain.recv(CHUNK):
                send_frame(sealed, 0, chunk, sealer)
        except OSError:
            pass   # ours closed, or the sealed side broke: its reader says why
        end(None)

    def inward() -> None:
        try:
            while True:
                _, payload = recv_frame(sealed, opener)
                plain.sendall(payload)
        except FrameError as e:
            closed = "closed by the peer" in str(e) or ended[0]
            end(None if closed else str(e))
        except OSError:
            end(None)

    for target in (outward, inward):
        threading.Thread(target=target, daemon=True, name="qcomm-relay").start()
