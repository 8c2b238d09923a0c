"""A link through the rendezvous's relay (:mod:`qcomm.rendezvous.link_relay`): what two
members that both accept nothing (both behind a NAT) link by. Each dials the relay and names
the link; once the relay has both it splices them, and the link's own handshake (the token's
challenge and response) and its keys run end to end between the two members through it.
"""

from __future__ import annotations

import socket
import struct
import threading

from qcomm.rendezvous.link_relay import PAIRED, RELAY_LINK
from qcomm.rendezvous.waiting import WaitAbandoned, raise_if_abandoned
from qcomm.wire.admission import HANDSHAKE_TIMEOUT_S, AdmissionError, cut, dial
from qcomm.wire.frames import FrameError, recv_exact

from .listener import CLAIM_POLL_S, connect_to

__all__ = ["dial_relay"]


def dial_relay(address: str, link: str, side: str, token: bytes | None, timeout_s: float
               ) -> socket.socket:
    """A connection to the relay at ``address`` (``"HOST:PORT"``) spliced to the other end of
    ``link``, where this end plays ``side`` (``"dial"`` or ``"accept"``) in the link's own
    handshake, which the caller runs on it next. Waits up to ``timeout_s`` for the other end.

    Raises:
        RuntimeError: the relay cannot be reached, refused this end, or the other end did not
            come, saying which.
    """
    sock = connect_to(address, "the relay", timeout_s)
    # A read waits through socket timeouts (frames.recv_exact): this timer bounds the relay's
    # handshake and the wait for the other end, cutting a relay that says nothing.
    deadline = threading.Timer(HANDSHAKE_TIMEOUT_S + timeout_s, cut, args=(sock,))
    deadline.start()
    try:
        dial(sock, {"link": RELAY_LINK, "pair": link, "side": side}, token)
        answer = _pairing_answer(sock)
        if answer != PAIRED:
            (n,) = struct.unpack("!H", recv_exact(sock, 2))
            raise AdmissionError(bytes(recv_exact(sock, n)).decode(errors="replace"))
    except (AdmissionError, FrameError, OSError) as e:
        sock.close()
        raise RuntimeError(f"link through the relay at {address}: {e}") from e
    except WaitAbandoned:
        sock.close()
        raise
    finally:
        deadline.cancel()
    return sock


def _pairing_answer(sock: socket.socket) -> bytes:
    """The relay's first byte once it has both ends (or its refusal's), read in slices of
    :data:`CLAIM_POLL_S`: the wait for the other end, which may never come, ends at the next
    slice once the calling thread's wait is abandoned (its link's streams closed:
    :func:`~qcomm.rendezvous.waiting.abandon_when`), not at its bound.

    Raises:
        WaitAbandoned: the wait was abandoned; FrameError: the relay closed the connection.
    """
    before = sock.gettimeout()
    sock.settimeout(CLAIM_POLL_S)
    try:
        while True:
            raise_if_abandoned()
            try:
                got = sock.recv(1)
            except TimeoutError:
                continue
            if not got:
                raise FrameError("connection closed by the peer")
            return got
    finally:
        sock.settimeout(before)
