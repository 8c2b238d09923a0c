"""A man in the middle flips one byte of an encrypted socket link: the frame fails its
authentication, the link ends as a lost peer named on both sides
(:class:`~qcomm.collectives.errors.PeerLostError`), and every message delivered before it is the
one sent: a changed byte never becomes a changed message."""

from __future__ import annotations

import contextlib
import socket
import threading

from qcomm.collectives.errors import PeerLostError
from qcomm.testing.multiprocess import free_ports

from .test_group import SECRET, run_pair

FLIP_AT = 900   # bytes from the dialler: past its handshake (~200 bytes), inside a frame


def _forward(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
    seen = 0
    try:
        while data := src.recv(65536):
            if flip_at is not None and seen <= flip_at < seen + len(data):
                data = bytearray(data)
                data[flip_at - seen] ^= 0x01
            seen += len(data)
            dst.sendall(data)
    except OSError:
        pass   # the other side closed first: close this one too
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _proxy(listening: socket.socket, target: int) -> None:
    """Accept one connection, open one to ``target``, forward both ways, flipping the
    dialler's byte at :data:`FLIP_AT`."""
    listening.settimeout(20)
    conn, _ = listening.accept()
    upstream = socket.create_connection(("127.0.0.1", target), timeout=20)
    for s in (conn, upstream):
        s.settimeout(20)
    threading.Thread(target=_forward, args=(conn, upstream, FLIP_AT), daemon=True).start()
    threading.Thread(target=_forward, args=(upstream, conn, None), daemon=True).start()


def test_a_flipped_byte_ends_the_link_as_a_lost_peer_named() -> None:
    real, front = free_ports(2)
    listening = socket.create_server(("127.0.0.1", front))
    proxy = threading.Thread(target=_proxy, args=(listening, real), daemon=True)
    proxy.start()
    # Member 0 listens behind the proxy (its advertised address); member 1 dials through it.
    # Both take until their stream ends: member 0's 30 messages may all reach member 1 before
    # member 0 reads the flipped frame and ends the link (seen: member 1 stopped at 30, its
    # stream not yet failed).
    out = run_pair(({"listen": f"127.0.0.1:{real}", "advertise": f"127.0.0.1:{front}",
                     "token": SECRET}, {"listen": "", "token": SECRET}), count=30,
                   until_end=True)
    proxy.join(5)
    listening.close()
    sent_by_1 = out[1][0]
    _, got_by_0, err0 = out[0]
    _, _, err1 = out[1]
    assert isinstance(err0, PeerLostError) and err0.peers == [1], err0
    assert "failed its authentication" in str(err0)
    assert isinstance(err1, PeerLostError) and err1.peers == [0], err1
    assert len(got_by_0) < 30   # the tampered frame and all after it were not delivered
    assert all(a.equal(b) for a, b in zip(got_by_0, sent_by_1, strict=False))
