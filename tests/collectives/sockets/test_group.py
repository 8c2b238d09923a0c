"""The socket links' group (:class:`~qcomm.collectives.sockets.SocketGroup`): bad arguments and
environment variables are named (a token's value never), one listener per address per process,
and two members in threads of one process link through the rendezvous and stream to each other
with the same bits, one dialling the other's port."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.gloo.streams import GlooStreams
from qcomm.collectives.sockets import AdmissionError, SocketGroup, job_token
from qcomm.collectives.sockets.listener import listener_at
from qcomm.rendezvous import serve
from qcomm.rendezvous.link_relay import RELAY_KEY
from qcomm.rendezvous.seat import claim_incarnation
from qcomm.testing.multiprocess import free_ports
from qcomm.wire.admission import dial

SECRET = "s3cret-job-token-0123"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"listen": "nowhere"}, "listen must be 'HOST:PORT'"),
    ({"listen": "127.0.0.1:70000"}, "listen must be 'HOST:PORT'"),
    ({"token": "short"}, "token must be a string of at least 16"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        SocketGroup("127.0.0.1:1", 0, 2, **kwargs)
    if "token" in kwargs:
        assert kwargs["token"] not in str(e.value)


def test_qcomm_encrypt_is_0_or_1(monkeypatch) -> None:
    monkeypatch.setenv("QCOMM_ENCRYPT", "off")
    with pytest.raises(ValueError, match="QCOMM_ENCRYPT must be 0 or 1, got 'off'"):
        SocketGroup("127.0.0.1:1", 0, 2, token=SECRET)


def test_the_token_comes_from_the_environment_and_is_never_shown(monkeypatch) -> None:
    monkeypatch.setenv("QCOMM_TOKEN", SECRET)
    assert job_token(None) == SECRET.encode()
    monkeypatch.setenv("QCOMM_TOKEN", "tiny")
    with pytest.raises(ValueError, match="QCOMM_TOKEN must be") as e:
        job_token(None)
    assert "tiny" not in str(e.value)
    monkeypatch.delenv("QCOMM_TOKEN")
    assert job_token(None) is None


def test_one_listener_per_address_and_token() -> None:
    (port,) = free_ports(1)
    first = listener_at(f"127.0.0.1:{port}", None)
    assert listener_at(f"127.0.0.1:{port}", None) is first
    assert first.address == f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match="with another job token"):
        listener_at(f"127.0.0.1:{port}", SECRET.encode())
    first.close()


def test_refusals_are_counted_and_logged_once_per_address(caplog) -> None:
    listener = listener_at("127.0.0.1:0", SECRET.encode())
    for token in (b"a-wrong-token-0123456789", None, b"another-wrong-one-0123456789"):
        with socket.create_connection(("127.0.0.1", int(listener.address.rsplit(":")[1])),
                                      timeout=5) as sock:
            sock.settimeout(5)
            with pytest.raises(AdmissionError, match="wrong or missing job token"):
                dial(sock, {"link": "x"}, token)
    for _ in range(100):   # the listener's threads count after the dialler hears
        if listener.refused == 3:
            break
        time.sleep(0.05)
    assert listener.refused == 3
    lines = [r for r in caplog.records if "refused a connection from 127.0.0.1" in r.message]
    assert len(lines) == 1 and SECRET not in lines[0].message


def _goodbye(message: torch.Tensor, sender: int) -> str | None:
    return "goodbye" if int(message[0]) == 255 else None


def _member(port: int, member: int, out: dict, count: int = 5, until_end: bool = False,
            **group_kwargs) -> None:
    """Member ``member`` of 2: opens its stream to the other, sends ``count`` random
    messages, takes what comes until ``count`` came (``until_end``: until the stream fails,
    whatever came) or the stream failed; ``out[member]`` is (sent, received, the stream's
    error or None)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    claim_incarnation(store, member)
    group = SocketGroup(f"127.0.0.1:{port}", member, 2, timeout_s=10, name="threads",
                        **group_kwargs)
    streams = GlooStreams(group.ranks, None, member, [1 - member], 64, max_backlog=8,
                          timeout_s=10, stream_end=_goodbye, connect=group.connect)
    # The link made (or failed) before the first send: a backlog sent into a link not made yet
    # waits for it only half the silence bound (seen: a store connection stalled 5 s by a name
    # lookup that timed out, and both ends gave up on the backlog first).
    assert streams.wait_made(20)
    g = torch.Generator().manual_seed(member)
    sent = [torch.randint(0, 255, (64,), dtype=torch.uint8, generator=g) for _ in range(count)]
    for m in sent:
        streams.send(m)
    got: list[torch.Tensor] = []
    err = None
    for _ in range(100):
        msgs, err = streams.take(0)
        got += msgs
        if (len(got) == count and not until_end) or err is not None:
            break
        streams.wait_any(0.2)
    out[member] = (sent, got, err)
    streams.close(torch.full((64,), 255, dtype=torch.uint8))


def run_pair(kwargs: tuple[dict, dict], count: int = 5, relay: str | None = None,
             until_end: bool = False) -> dict:
    """Members 0 and 1 (:func:`_member`, ``kwargs[m]`` for member m's group) in threads, over
    a rendezvous in a thread (that names ``relay``, ``"HOST:PORT"``, as its relay); what each
    ended with."""
    (port,) = free_ports(1)
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=("127.0.0.1", port, 2),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    server.start()
    assert ready.wait(10)
    if relay is not None:
        dist.TCPStore("127.0.0.1", port, is_master=False,
                      timeout=datetime.timedelta(seconds=10)).set(RELAY_KEY, relay)
    out: dict = {}
    threads = [threading.Thread(target=_member, args=(port, m, out, count, until_end),
                                kwargs=kwargs[m])
               for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    server.join(5)
    assert sorted(out) == [0, 1]
    return out


@pytest.mark.parametrize("listens", [(True, True), (False, True)], ids=["both", "one"])
@pytest.mark.parametrize("token", [None, SECRET], ids=["plain", "encrypted"])
def test_two_members_stream_the_same_bits_over_their_ports(listens: tuple[bool, bool],
                                                           token: str | None) -> None:
    """Both listen (the higher dials), or member 0 has no port (behind a NAT: it dials);
    without a token, or with one (each link then encrypted)."""
    out = run_pair(tuple({"listen": "127.0.0.1:0" if listens[m] else "", "token": token}
                         for m in (0, 1)))
    for m in (0, 1):
        sent, _, _ = out[m]
        _, got, err = out[1 - m]
        assert err is None, err
        assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
