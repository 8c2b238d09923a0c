"""The rendezvous of a job with a token, as processes on localhost: ``python -m qcomm.rendezvous``
with ``QCOMM_TOKEN`` in its environment admits only the token's holders, over encrypted
connections. A node with a wrong token, and one with none, are refused at once with a named
error, logged once at the rendezvous (never the token), and take no seat; the running node
goes on. A byte changed on the way ends that
connection, named, and the store is unchanged."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

import pytest

from qcomm.rendezvous.gate import HELLO
from qcomm.rendezvous.tunnel import Tunnel
from qcomm.testing.multiprocess import free_port
from qcomm.wire.admission import dial
from qcomm.wire.aead import link_keys
from qcomm.wire.frames import send_frame
from tests.rendezvous.test_launch import ENV

TOKEN = "the-job-token-0123456789abcdef"
WAIT_S = 90   # a hang fails the test

# A node of one process: takes its seat, says which, then (with "hold") waits for the test's
# key before it reads the store again and exits.
NODE = """
import sys, datetime
from qcomm.rendezvous import init_node
seat = init_node(timeout_s=30)
print(f"seat {seat.node}", flush=True)
if sys.argv[1:] == ["hold"]:
    store = seat.store()
    store.wait(["test/go"], datetime.timedelta(seconds=60))
    print("read", store.get("test/go").decode(), flush=True)
"""


def _node(address: str, token: str | None, *args: str) -> subprocess.Popen:
    env = dict(ENV, QCOMM_RENDEZVOUS=address)
    env.pop("QCOMM_TOKEN", None)
    if token is not None:
        env["QCOMM_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-c", NODE, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture
def gated_rendezvous():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1",
                          "--port", str(port), "--nodes", "2"], env=dict(ENV, QCOMM_TOKEN=TOKEN),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = p.stdout.readline()
    assert "admitting only the job token's holders, encrypted" in line, line
    yield port, p
    p.kill()
    p.wait(timeout=10)


def _store_through_tunnel(port: int):
    import torch.distributed as dist

    tunnel = Tunnel("127.0.0.1", port, TOKEN.encode(), 10.0)
    return dist.TCPStore("127.0.0.1", tunnel.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10)), tunnel


def test_only_the_token_holders_take_seats_and_the_running_node_goes_on(gated_rendezvous
                                                                          ) -> None:
    port, rendezvous = gated_rendezvous
    address = f"127.0.0.1:{port}"
    first = _node(address, TOKEN, "hold")
    assert first.stdout.readline().strip() == "seat 0"
    # one after the other, so that the rendezvous logs the wrong token's refusal (the first
    # from this address) and only counts the second
    strays, outs = [], []
    for token in ("a-wrong-token-0123456789", None):
        strays.append(_node(address, token))
        outs.append(strays[-1].communicate(timeout=WAIT_S)[0])
    for s, out in zip(strays, outs, strict=True):
        assert s.returncode != 0, out
        assert "AdmissionError" in out, out
        assert not any(line.startswith("seat ") for line in out.splitlines()), out
    assert "refused by the other node: wrong or missing job token" in outs[0], outs[0]
    assert "admits only the holders of the job token: set QCOMM_TOKEN" in outs[1], outs[1]
    # neither took a seat: seat 1 is free
    store, _ = _store_through_tunnel(port)
    assert store.check(["qcomm/linked/seat/0"]) and not store.check(["qcomm/linked/seat/1"])
    # the running node goes on: it reads the store after the strays
    store.set("test/go", "on")
    out, _ = first.communicate(timeout=WAIT_S)
    assert first.returncode == 0 and out.strip().endswith("read on"), out
    rendezvous.kill()
    log = rendezvous.communicate(timeout=10)[0]
    # one refusal logged (both strays came from 127.0.0.1), why, and never the token
    assert log.count("refused a connection from 127.0.0.1") == 1, log
    assert "wrong or missing job token (no seat taken" in log, log
    assert TOKEN not in log and TOKEN not in out


def test_a_changed_byte_ends_the_connection_named_and_changes_nothing(gated_rendezvous
                                                                      ) -> None:
    port, rendezvous = gated_rendezvous
    store, _ = _store_through_tunnel(port)
    store.set("test/key", "before")
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    admitted = dial(sock, HELLO, TOKEN.encode())
    sealer, _ = link_keys(TOKEN.encode(), admitted, dialler=True)

    class Flip:   # seals, then changes one byte on the way
        overhead = sealer.overhead

        def seal(self, body: bytes) -> bytes:
            sealed = bytearray(sealer.seal(body))
            sealed[3] ^= 0x01
            return bytes(sealed)

    # a TCPStore "set test/key" would be in this frame; its byte changed, it never arrives
    send_frame(sock, 0, b"\x00" * 64, Flip())
    assert sock.recv(1) == b""   # the rendezvous ended the connection
    sock.close()
    assert store.get("test/key") == b"before"   # the store and the other connections go on
    rendezvous.kill()
    log = rendezvous.communicate(timeout=10)[0]
    assert "ended the connection from 127.0.0.1" in log, log
    assert "frame 0 failed its authentication: altered, dropped or replayed" in log, log
