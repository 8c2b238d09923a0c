"""The listener's claim (:meth:`qcomm.collectives.sockets.listener.Listener.claim`): a link
waiting for its other end to connect leaves its wait at once when its streams abandon it or the
listener closes, not at its bound; a connection that never comes is a TimeoutError in the
bound."""

from __future__ import annotations

import errno
import socket
import threading
import time

import pytest

from qcomm.collectives.sockets.listener import Listener, listener_at
from qcomm.rendezvous.waiting import WaitAbandoned, abandon_when


def _claim_in_thread(listener: Listener, abandoned: threading.Event | None = None,
                     timeout_s: float = 60.0) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def claim() -> None:
        t0 = time.monotonic()
        try:
            if abandoned is None:
                listener.claim("qcomm/link/g/0.1-1.1/1/", timeout_s)
            else:
                with abandon_when(abandoned.is_set, "gossip link to rank 1"):
                    listener.claim("qcomm/link/g/0.1-1.1/1/", timeout_s)
        except Exception as e:   # what ended the wait, and when
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=claim, daemon=True)
    t.start()
    return t, out


def test_a_claim_whose_wait_is_abandoned_leaves_at_once() -> None:
    listener = Listener("127.0.0.1", 0, None)
    try:
        abandoned = threading.Event()
        t, out = _claim_in_thread(listener, abandoned)
        time.sleep(0.3)
        assert t.is_alive()                  # waiting for the other end
        abandoned.set()
        t.join(5)
        assert not t.is_alive()
        assert isinstance(out["error"], WaitAbandoned), out
        assert "gossip link to rank 1: abandoned" in str(out["error"])
        assert out["took"] < 5.0             # not the 60 s bound
    finally:
        listener.close()


def test_closing_the_listener_ends_a_claim_waiting_on_it() -> None:
    listener = Listener("127.0.0.1", 0, None)
    t, out = _claim_in_thread(listener)
    time.sleep(0.3)
    listener.close()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(out["error"], RuntimeError) and not isinstance(out["error"], TimeoutError)
    assert "closed while the link waited for its other end" in str(out["error"])
    assert out["took"] < 5.0


def test_a_claim_nobody_answers_is_a_timeout_in_its_bound() -> None:
    listener = Listener("127.0.0.1", 0, None)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not connect to 127\.0\.0\.1:\d+ within "
                                               r"0\.3 s"):
            listener.claim("qcomm/link/g/0.1-1.1/1/", 0.3)
        assert 0.3 <= time.monotonic() - t0 < 3.0
    finally:
        listener.close()


def test_an_address_no_listener_can_take_is_named_with_why() -> None:
    """A host of no interface here (TEST-NET-3) and a port another socket listens on: each an
    OSError with the OS's errno, naming the address and the settings it comes from (the OS's
    own words named neither)."""
    with pytest.raises(OSError, match=r"cannot accept links on 203\.0\.113\.7:0 \(listen, "
                       r"QCOMM_LISTEN\)") as e:
        listener_at("203.0.113.7:0", None)
    assert e.value.errno == errno.EADDRNOTAVAIL
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot accept links on 127.0.0.1:{port}") as e:
            listener_at(f"127.0.0.1:{port}", None)
        assert e.value.errno == errno.EADDRINUSE
