"""Length-prefixed frames on one TCP connection: what a socket link's messages travel as.

A frame is a 4-byte big-endian length, then that many bytes of body; the body is the message's
tag (8 bytes, big-endian) and its bytes, sealed (:mod:`.seal`) when the link is encrypted. A
length above :data:`MAX_FRAME` is refused before anything is allocated for it: a stray or
broken peer cannot make this end reserve gigabytes.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["MAX_FRAME", "FrameError", "recv_exact", "recv_frame", "send_frame"]

# The largest body accepted: a gossip message or a whole vector (a model's parameters) fits.
MAX_FRAME = 1 << 31
_LEN = struct.Struct("!I")
_TAG = struct.Struct("!Q")


class FrameError(ConnectionError):
    """The connection ended, or carried what no frame is (a bad length, a body that fails
    its seal)."""


class Opener:
    """Turns a received body back into its plain bytes (identity on a plain link)."""

    def open(self, body: bytearray) -> bytes | bytearray:
        return body


class Sealer:
    """Turns a body to send into its bytes on the wire (identity on a plain link)."""

    overhead = 0

    def seal(self, body: bytes) -> bytes:
        return body


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """The next ``n`` bytes of ``sock`` (a socket timeout between them is waited through: a
    link may be silent; only a closed connection ends the read).

    Raises:
        FrameError: the connection closed or broke first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            continue
        except OSError as e:
            raise FrameError(f"connection broke: {e}") from e
        if k == 0:
            raise FrameError("connection closed by the peer")
        got += k
    return buf


def send_frame(sock: socket.socket, tag: int, payload: bytes | memoryview,
               sealer: Sealer) -> int:
    """Send one frame: ``tag`` (0 <= tag < 2**64) and ``payload`` (any bytes), sealed by
    ``sealer``. Returns the bytes put on the wire.

    Raises:
        OSError: the connection broke, or a send waited past the socket's timeout.
    """
    # One copy of the payload (the join), none more: the length goes on its own send.
    body = sealer.seal(b"".join((_TAG.pack(tag), payload)))
    sock.sendall(_LEN.pack(len(body)))
    sock.sendall(body)
    return _LEN.size + len(body)


def recv_frame(sock: socket.socket, opener: Opener) -> tuple[int, memoryview]:
    """The next frame of ``sock``: its tag and payload (a view of the opened body, not a
    copy), opened by ``opener``.

    Raises:
        FrameError: the connection ended, the length is out of range, or the body fails its
            seal.
    """
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if not _TAG.size <= n <= MAX_FRAME:
        raise FrameError(f"a frame of {n} bytes (at most {MAX_FRAME}): not a link's frame")
    body = opener.open(recv_exact(sock, n))
    if len(body) < _TAG.size:
        raise FrameError("a frame shorter than its tag")
    (tag,) = _TAG.unpack_from(body)
    return tag, memoryview(body)[_TAG.size:]
