"""Who may open a link on a node's port: the opening handshake of a socket link, with the job
token's challenge and response when the job has one.

The accepting end sends a greeting: a fresh 32-byte nonce and whether it requires the token.
The dialling end answers with its own nonce, its *hello* (a small JSON naming the link, its
member and incarnation: what the acceptor routes it by) and, with a token, the HMAC-SHA256 of
both nonces and the hello under the token. The acceptor checks it and answers with its own
HMAC (other label, same nonces), which the dialler checks in turn: each end proves it holds
the token, neither sends it, and a recorded handshake is useless again (fresh nonces). A
dialler without the right token is refused before its hello is read as anything: it takes no
link and none of its bytes reach the gossip.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct

from .frames import FrameError, recv_exact

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAGIC", "AdmissionError", "Admitted", "accept", "cut",
           "dial"]

_MAGIC = b"qcomm/1\0"
MAGIC = _MAGIC   # what an accepting end's greeting starts with (a probe tells a gate by it)
_NONCE = 32
_MAC = 32
_HELLO_MAX = 4096
# The longest a handshake may take: a process that connects and says nothing is dropped then.
HANDSHAKE_TIMEOUT_S = 10.0


class AdmissionError(PermissionError):
    """A link was refused: the other end does not hold the job's token (or holds one where
    the job has none), or its hello is not a link's."""


class Admitted:
    """What a handshake leaves: the hello (``dict``, and ``body``, its bytes as sent) and both
    nonces (``nonces``: the acceptor's then the dialler's; with ``body``, what the link's
    keys are derived over)."""

    def __init__(self, hello: dict, body: bytes, nonces: bytes) -> None:
        self.hello, self.body, self.nonces = hello, body, nonces


def cut(sock: socket.socket) -> None:
    """End ``sock``'s connection now, waking a read that waits on it (a handshake's
    deadline)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _mac(token: bytes, label: bytes, nonces: bytes, hello: bytes) -> bytes:
    return hmac.new(token, label + nonces + hello, hashlib.sha256).digest()


def dial(sock: socket.socket, hello: dict, token: bytes | None) -> Admitted:
    """The dialling end's half, on a connected ``sock`` (its timeout bounds each read).

    Raises:
        AdmissionError: the acceptor refused this end (saying why), requires a token this end
            lacks or lacks the one this end has, or could not prove it holds the token.
        FrameError: the connection ended during the handshake, or the other end is no link.
    """
    greeting = bytes(recv_exact(sock, len(_MAGIC) + _NONCE + 1))
    if not greeting.startswith(_MAGIC):
        raise FrameError("the other end is not a qcomm link's port")
    theirs, wants_token = greeting[len(_MAGIC):-1], greeting[-1] == 1
    # Without a token where one is wanted, the hello still goes (with no proof): the acceptor
    # refuses it and says so in its own log, where the job's operator looks.
    if token is not None and not wants_token:
        raise AdmissionError("this node has a job token (QCOMM_TOKEN) and the other node "
                             "admits without one")
    mine = os.urandom(_NONCE)
    body = json.dumps(hello, sort_keys=True).encode()
    nonces = theirs + mine
    mac = _mac(token, b"dial", nonces, body) if token is not None else bytes(_MAC)
    sock.sendall(mine + struct.pack("!H", len(body)) + body + mac)
    answer = bytes(recv_exact(sock, 1))
    if answer != b"Y":
        (n,) = struct.unpack("!H", recv_exact(sock, 2))
        why = bytes(recv_exact(sock, n)).decode(errors="replace")
        hint = " (this node has no QCOMM_TOKEN)" if token is None else ""
        raise AdmissionError(f"refused by the other node: {why}{hint}")
    proof = bytes(recv_exact(sock, _MAC))
    if token is not None and not hmac.compare_digest(proof, _mac(token, b"accept", nonces,
                                                                  body)):
        raise AdmissionError("the other node does not hold the job token")
    return Admitted(hello, body, nonces)


def _refuse(sock: socket.socket, why: str) -> AdmissionError:
    reason = why.encode()
    with contextlib.suppress(OSError):   # it left already: the refusal stands
        sock.sendall(b"N" + struct.pack("!H", len(reason)) + reason)
    return AdmissionError(why)


def accept(sock: socket.socket, token: bytes | None) -> Admitted:
    """The accepting end's half, on a just-accepted ``sock`` (its timeout bounds each read).

    Raises:
        AdmissionError: the dialler does not hold the token or sent no link's hello (it was
            told so, without a proof of ours).
        FrameError: the connection ended during the handshake.
    """
    mine = os.urandom(_NONCE)
    sock.sendall(_MAGIC + mine + bytes([token is not None]))
    theirs = bytes(recv_exact(sock, _NONCE))
    (n,) = struct.unpack("!H", recv_exact(sock, 2))
    if n > _HELLO_MAX:
        raise _refuse(sock, f"a hello of {n} bytes (at most {_HELLO_MAX})")
    body = bytes(recv_exact(sock, n))
    mac = bytes(recv_exact(sock, _MAC))
    nonces = mine + theirs
    if token is not None and not hmac.compare_digest(mac, _mac(token, b"dial", nonces, body)):
        raise _refuse(sock, "wrong or missing job token")
    try:
        hello = json.loads(body)
        if not isinstance(hello, dict) or not isinstance(hello.get("link"), str):
            raise ValueError("no link named")
    except ValueError as e:
        raise _refuse(sock, f"not a link's hello ({e})") from None
    proof = _mac(token, b"accept", nonces, body) if token is not None else bytes(_MAC)
    sock.sendall(b"Y" + proof)
    return Admitted(hello, body, nonces)
