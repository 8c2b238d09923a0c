"""Two members that both accept nothing link through the rendezvous's relay
(:mod:`qcomm.collectives.sockets.relayed`): they stream the same bits, the link's handshake
and encryption end to end (the relay never carries a message's bytes in clear, and a byte it
flips ends the link as a lost peer named, nothing changed delivered); without a relay the
error says how to get one."""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from qcomm.collectives.errors import PeerLostError
from qcomm.collectives.sockets.relayed import dial_relay
from qcomm.rendezvous.link_relay import LinkRelay
from qcomm.rendezvous.waiting import WaitAbandoned, abandon_when

from .test_group import SECRET, run_pair

NO_PORT = {"listen": "", "token": SECRET}


class _Recording(LinkRelay):
    """A relay that keeps every byte it carries."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = bytearray()

    def _carry(self, chunk: bytes, src: socket.socket) -> bytes:
        self.seen += chunk
        return chunk


class _Flipping(LinkRelay):
    """A relay that flips one byte of what it carries, past both handshakes."""

    FLIP_AT = 900

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.carried: dict[int, int] = {}
        self.flipped = False

    def _carry(self, chunk: bytes, src: socket.socket) -> bytes:
        seen = self.carried.get(src.fileno(), 0)
        self.carried[src.fileno()] = seen + len(chunk)
        if seen <= self.FLIP_AT < seen + len(chunk) and not self.flipped:
            self.flipped = True   # one byte, in whichever direction gets there first
            chunk = bytearray(chunk)
            chunk[self.FLIP_AT - seen] ^= 0x01
        return bytes(chunk)


def _address(relay: LinkRelay) -> str:
    return f"127.0.0.1:{relay.port}"


def test_two_members_without_ports_stream_the_same_bits_through_the_relay(caplog) -> None:
    relay = _Recording("127.0.0.1", 0, SECRET.encode(), wait_s=20)
    with caplog.at_level(logging.INFO, logger="qcomm.collectives.sockets.group"):
        out = run_pair((NO_PORT, NO_PORT), relay=_address(relay))
    relay.close()
    for m in (0, 1):
        sent, _, _ = out[m]
        _, got, err = out[1 - m]
        assert err is None, err
        assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(sent, got, strict=True))
        # the relay carried sealed frames only: no message's bytes went through it in clear
        assert not any(bytes(s.numpy()) in relay.seen for s in sent)
    assert relay.spliced == 1 and len(relay.seen) > 5 * 2 * 64
    lines = [r.getMessage() for r in caplog.records if "relayed through" in r.getMessage()]
    assert sorted(lines) == sorted(
        f"link to rank {m}: TCP, relayed through {_address(relay)}, token checked, encrypted"
        for m in (0, 1)), lines


def test_a_byte_flipped_by_the_relay_ends_the_link_as_a_lost_peer_named() -> None:
    relay = _Flipping("127.0.0.1", 0, SECRET.encode(), wait_s=20)
    # until_end: the other end's messages may all arrive before the flipped frame ends the link
    out = run_pair((NO_PORT, NO_PORT), count=30, relay=_address(relay), until_end=True)
    relay.close()
    assert relay.flipped
    errs = [out[m][2] for m in (0, 1)]
    assert any(isinstance(e, PeerLostError) and "failed its authentication" in str(e)
               for e in errs), errs
    for m in (0, 1):
        assert isinstance(errs[m], PeerLostError) and errs[m].peers == [1 - m], errs[m]
        sent, got = out[1 - m][0], out[m][1]
        assert all(a.equal(b) for a, b in zip(got, sent, strict=False))
    assert min(len(out[0][1]), len(out[1][1])) < 30   # the flipped frame was not delivered


def test_without_a_port_on_either_end_nor_a_relay_the_error_says_so() -> None:
    out = run_pair((NO_PORT, NO_PORT))
    for m in (0, 1):
        err = out[m][2]
        assert err is not None and "the rendezvous relays no links (--relay-port)" in str(err)


def test_a_wait_for_the_other_end_through_the_relay_is_abandoned_at_once() -> None:
    """One end dials the relay and the other never comes: while the relay holds it (its own
    wait, 30 s here), the link's streams closing abandons the wait within a slice, and the
    connection to the relay is closed (the relay sees it go)."""
    relay = LinkRelay("127.0.0.1", 0, SECRET.encode(), wait_s=30)
    abandoned = threading.Event()
    out: dict = {}

    def dial_alone() -> None:
        t0 = time.monotonic()
        try:
            with abandon_when(abandoned.is_set, "gossip link to rank 1"):
                dial_relay(_address(relay), link, "dial", SECRET.encode(), 30)
        except Exception as e:   # what ended the wait, and when
            out["error"] = e
        out["took"] = time.monotonic() - t0

    link = "qcomm/link/g/0.1-1.1/1/"
    t = threading.Thread(target=dial_alone, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while link not in relay._waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        assert link in relay._waiting            # the relay holds this end for the other
        abandoned.set()
        t.join(5)
        assert not t.is_alive()
        assert isinstance(out["error"], WaitAbandoned), out
        assert out["took"] < 10.0                # not the relay's 30 s
        assert relay._waiting[link].gone()       # its connection to the relay closed
    finally:
        relay.close()
