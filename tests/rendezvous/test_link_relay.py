"""The relay of the links whose two ends both accept nothing (:mod:`qcomm.rendezvous.link_relay`):
two connections naming the same link are spliced (bytes both ways, both closed when one
closes; one that closed while it waited makes way for the next); a lone one is told its other
end did not come and closed; a third for a spliced link, a second end that says the same side,
and one without the job token are refused; the rendezvous publishes the relay's address, and
names a bad ``--relay-port``."""

from __future__ import annotations

import datetime
import socket
import struct
import threading

import pytest
import torch.distributed as dist

from qcomm.rendezvous import serve
from qcomm.rendezvous.__main__ import main
from qcomm.rendezvous.link_relay import PAIRED, RELAY_KEY, LinkRelay
from qcomm.testing.multiprocess import free_ports
from qcomm.wire.admission import AdmissionError, dial
from qcomm.wire.frames import recv_exact

TOKEN = b"the-job-token-0123456789abcdef"


@pytest.fixture
def relay():
    # A wait bound no loaded machine outlasts between two ends' connects (with 1 s, the second
    # dialler of a link came after the first had given up, once in a whole run); the lone end's
    # test has a relay of its own that gives up sooner.
    r = LinkRelay("127.0.0.1", 0, TOKEN, wait_s=60.0, max_waiting=4)
    yield r
    r.close()


def _end(relay: LinkRelay, link: str, side: str, token: bytes | None = TOKEN
         ) -> socket.socket:
    """A connection to ``relay`` admitted for ``link``'s ``side`` (nothing read after)."""
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    dial(sock, {"link": "relay", "pair": link, "side": side}, token)
    return sock


def _answer(sock: socket.socket) -> str:
    """``"paired"``, or why the relay refused ``sock``."""
    if bytes(recv_exact(sock, 1)) == PAIRED:
        return "paired"
    (n,) = struct.unpack("!H", recv_exact(sock, 2))
    return bytes(recv_exact(sock, n)).decode()


def test_two_ends_of_a_link_are_spliced_and_both_close_when_one_does(relay) -> None:
    a, b = _end(relay, "qcomm/link/x/0.1-1.1/1/", "accept"), \
        _end(relay, "qcomm/link/x/0.1-1.1/1/", "dial")
    assert _answer(a) == _answer(b) == "paired"
    a.sendall(b"hello from a")
    assert bytes(recv_exact(b, 12)) == b"hello from a"
    b.sendall(b"x" * 300_000)   # more than one chunk
    assert bytes(recv_exact(a, 300_000)) == b"x" * 300_000
    a.close()
    assert b.recv(1) == b""   # the relay closed the other side too
    b.close()
    assert relay.spliced == 1


def test_a_lone_end_is_told_and_closed() -> None:
    relay = LinkRelay("127.0.0.1", 0, TOKEN, wait_s=1.0, max_waiting=4)
    try:
        lone = _end(relay, "alone", "dial")
        assert _answer(lone) == "the other end of link alone did not come within 1 s"
        assert lone.recv(1) == b""
        assert relay.refused == 1
        lone.close()
    finally:
        relay.close()


def test_a_third_end_and_a_second_dialler_are_refused(relay) -> None:
    a, b = _end(relay, "busy", "dial"), _end(relay, "busy", "accept")
    assert _answer(a) == _answer(b) == "paired"
    third = _end(relay, "busy", "accept")
    assert _answer(third) == "link busy is relayed already"
    same = [_end(relay, "twice", "dial"), _end(relay, "twice", "dial")]
    assert _answer(same[1]) == "both ends of link twice say they dial"
    assert relay.refused == 2   # the third, the second dialler
    a.sendall(b"still")   # the splice goes on
    assert bytes(recv_exact(b, 5)) == b"still"
    for s in (a, b, third, *same):
        s.close()


def test_an_end_that_closed_while_it_waited_is_dropped_for_the_next(relay) -> None:
    _end(relay, "retried", "dial").close()   # gave up waiting
    threading.Event().wait(0.1)
    again, other = _end(relay, "retried", "dial"), None
    try:
        other = _end(relay, "retried", "accept")
        assert _answer(again) == _answer(other) == "paired"
        other.sendall(b"alive")
        assert bytes(recv_exact(again, 5)) == b"alive"
        assert relay.refused == 0
    finally:
        for s in (again, other):
            if s is not None:
                s.close()


def test_waiting_ends_are_bounded(relay) -> None:
    waiting = [_end(relay, f"w{i}", "dial") for i in range(4)]
    extra = _end(relay, "w4", "dial")
    assert _answer(extra) == "4 connections wait already"
    for s in (*waiting, extra):
        s.close()


def test_an_end_without_the_token_is_refused_and_logged_once(relay, capfd) -> None:
    for token in (b"a-wrong-token-0123456789", b"another-wrong-one-0123456789"):
        sock = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        with pytest.raises(AdmissionError, match="wrong or missing job token"):
            dial(sock, {"link": "relay", "pair": "x", "side": "dial"}, token)
        sock.close()
    for _ in range(100):
        if relay.refused == 2:
            break
        threading.Event().wait(0.05)
    assert relay.refused == 2
    err = capfd.readouterr().err
    assert err.count("relay refused a connection from 127.0.0.1") == 1, err
    assert TOKEN.decode() not in err


def test_the_rendezvous_publishes_its_relay() -> None:
    port, relay_port = free_ports(2)
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, 2), daemon=True,
                              kwargs={"ready": ready, "stop": stop, "relay_port": relay_port,
                                      "relay_advertise": f"relay.example:{relay_port}"})
    server.start()
    try:
        assert ready.wait(10)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        assert store.get(RELAY_KEY).decode() == f"relay.example:{relay_port}"
        with socket.create_connection(("127.0.0.1", relay_port), timeout=10):
            pass   # it listens
    finally:
        stop.set()
        server.join(5)


@pytest.mark.parametrize("value", ["0", "-1", "70000"])
def test_a_bad_relay_port_is_named(value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--nodes", "2", "--port", str(free_ports(1)[0]), "--relay-port", value])
    assert "--relay-port must be an int in [1, 65535]" in capsys.readouterr().err


def test_a_bad_relay_port_in_the_environment_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setenv("QCOMM_RELAY_PORT", "nine")
    with pytest.raises(SystemExit):
        main(["--nodes", "2"])
    assert "QCOMM_RELAY_PORT must be a port" in capsys.readouterr().err


def test_a_relay_advertise_needs_a_relay() -> None:
    with pytest.raises(ValueError, match="relay_advertise needs relay_port"):
        serve("127.0.0.1", free_ports(1)[0], 2, relay_advertise="h:1")
    with pytest.raises(ValueError, match="relay_advertise must be 'HOST:PORT'"):
        serve("127.0.0.1", free_ports(1)[0], 2, relay_port=1, relay_advertise="nowhere")


def test_the_rendezvous_process_relays_with_its_token() -> None:
    """``python -m qcomm.rendezvous --relay-port`` with ``QCOMM_TOKEN``: it says where it
    relays, and its relay admits the token's holders only."""
    import os
    import subprocess
    import sys

    port, relay_port = free_ports(2)
    env = dict(os.environ, QCOMM_TOKEN=TOKEN.decode(),
               PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1",
                          "--port", str(port), "--nodes", "2", "--relay-port", str(relay_port)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [p.stdout.readline() for _ in range(2)]
        assert f"relaying the links whose two ends both accept nothing on 127.0.0.1:" \
               f"{relay_port}" in lines[1], lines
        ends = []
        for token in (TOKEN, TOKEN, b"a-wrong-token-0123456789"):
            sock = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
            ends.append(sock)
            side = "dial" if len(ends) == 1 else "accept"
            if token == TOKEN:
                dial(sock, {"link": "relay", "pair": "l", "side": side}, token)
            else:
                with pytest.raises(AdmissionError, match="wrong or missing job token"):
                    dial(sock, {"link": "relay", "pair": "l", "side": side}, token)
        assert _answer(ends[0]) == _answer(ends[1]) == "paired"
        for s in ends:
            s.close()
    finally:
        p.kill()
        p.communicate(timeout=10)
