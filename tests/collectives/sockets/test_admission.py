"""A socket link's opening handshake (:mod:`qcomm.wire.admission`) over a
connected pair of sockets: the right token is admitted on both sides with the same nonces; a
wrong or missing token is refused by the acceptor, saying why, and a node that cannot prove it
holds the token is refused by the dialler; the token itself never crosses the wire."""

from __future__ import annotations

import re
import socket
import threading

import pytest

from qcomm.wire.admission import AdmissionError, accept, dial

TOKEN = b"the-job-token-0123456789"
HELLO = {"link": "qcomm/link/rail0/0.1-1.1/1/", "member": 1, "incarnation": 1}


class _Tap:
    """A socket that keeps a copy of everything sent on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.sent = sock, b""

    def sendall(self, data: bytes) -> None:
        self.sent += bytes(data)
        self.sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def _handshake(dial_token: bytes | None, accept_token: bytes | None) -> tuple[object, object]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(5)
    ta, tb = _Tap(a), _Tap(b)
    out: dict[str, object] = {}

    def acceptor() -> None:
        try:
            out["accept"] = accept(tb, accept_token)
        except Exception as e:
            out["accept"] = e
    t = threading.Thread(target=acceptor)
    t.start()
    try:
        out["dial"] = dial(ta, HELLO, dial_token)
    except Exception as e:
        out["dial"] = e
    a.close()   # an acceptor still reading sees the end
    t.join(10)
    b.close()
    for sent in (ta.sent, tb.sent):
        assert TOKEN not in sent and (dial_token is None or dial_token not in sent)
    return out["dial"], out["accept"]


def test_the_right_token_is_admitted_on_both_sides_with_the_same_nonces() -> None:
    d, a = _handshake(TOKEN, TOKEN)
    assert d.hello == a.hello == HELLO
    assert d.nonces == a.nonces and len(d.nonces) == 64


def test_no_token_on_either_side_admits_anyone() -> None:
    _, a = _handshake(None, None)
    assert a.hello == HELLO


@pytest.mark.parametrize(("dial_token", "accept_token", "dialler", "acceptor"), [
    (b"wrong-token-0123456789", TOKEN, "refused by the other node: wrong or missing job token",
     "wrong or missing job token"),
    (None, TOKEN, r"wrong or missing job token \(this node has no QCOMM_TOKEN\)",
     "wrong or missing job token"),
    (TOKEN, None, "this node has a job token .* admits without one", None),
])
def test_a_wrong_or_missing_token_is_refused(dial_token, accept_token, dialler, acceptor
                                              ) -> None:
    d, a = _handshake(dial_token, accept_token)
    assert isinstance(d, AdmissionError) and re.search(dialler, str(d)), d
    if acceptor is not None:
        assert isinstance(a, AdmissionError) and acceptor in str(a)
    else:
        assert not hasattr(a, "hello")   # the dialler left: nothing admitted


def test_a_node_that_cannot_prove_the_token_is_refused_by_the_dialler() -> None:
    """An impostor's port that takes any hello and answers with a made-up proof."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(5)

    def impostor() -> None:
        b.sendall(b"qcomm/1\0" + bytes(32) + b"\1")
        b.recv(4096)
        b.sendall(b"Y" + bytes(32))
    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(AdmissionError, match="does not hold the job token"):
        dial(a, HELLO, TOKEN)
    t.join(10)
    a.close()
    b.close()


@pytest.mark.parametrize("front", ["listener", "gate"])
def test_a_connection_that_says_nothing_is_cut_at_the_handshake_deadline(
        monkeypatch: pytest.MonkeyPatch, front: str) -> None:
    """A read waits through socket timeouts, so the deadline is a timer: without it a silent
    connection held its thread and an admission place for good."""
    import time

    from qcomm.collectives.sockets import listener as L
    from qcomm.rendezvous import gate as G

    monkeypatch.setattr(L if front == "listener" else G, "HANDSHAKE_TIMEOUT_S", 0.5)
    server = (L.Listener("127.0.0.1", 0, b"t" * 16) if front == "listener"
              else G.Gate("127.0.0.1", 0, 1, b"t" * 16))
    port = server.sock.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            greeting = sock.recv(64)
            assert greeting.startswith(b"qcomm/1\0")
            assert sock.recv(1) == b""   # cut by the acceptor, not by this end's timeout
            assert time.monotonic() - started < 5
    finally:
        server.close()
