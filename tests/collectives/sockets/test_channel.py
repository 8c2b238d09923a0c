"""One socket link's tagged sends and receives (:class:`~qcomm.collectives.sockets.SocketChannel`)
over a connected pair of sockets: the bytes arrive as sent, whatever order the receives are
posted in; a peer that leaves, a wait that times out and a message of the wrong size end the
link with a RuntimeError (what the streams turn into a lost or silent peer), quickly."""

from __future__ import annotations

import datetime
import socket
import struct
import time

import pytest
import torch

from qcomm.collectives.sockets import SocketChannel
from qcomm.wire.frames import MAX_FRAME, FrameError, Opener, recv_frame
from qcomm.wire.frames import Sealer as PlainSealer

WAIT = datetime.timedelta(seconds=10)


def _pair() -> tuple[SocketChannel, SocketChannel]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(10)
    return (SocketChannel(a, "rank 1", PlainSealer(), Opener()),
            SocketChannel(b, "rank 0", PlainSealer(), Opener()))


def test_messages_and_vectors_arrive_with_the_same_bits_whatever_the_posting_order() -> None:
    a, b = _pair()
    try:
        g = torch.Generator().manual_seed(0)
        msgs = [torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g)
                for _ in range(20)]
        vec = torch.randn(12345, dtype=torch.float64, generator=g)
        sends = [a.isend(m, t) for t, m in enumerate(msgs)] + [a.isend(vec, 1 << 20)]
        out_vec = torch.empty_like(vec)
        got_vec = b.irecv(out_vec, 1 << 20)   # posted first: the messages come before it
        outs = [torch.empty(1000, dtype=torch.uint8) for _ in msgs]
        works = {t: b.irecv(outs[t], t) for t in reversed(range(len(msgs)))}
        for w in [*sends, got_vec, *works.values()]:
            assert w.wait(WAIT)
        assert all(torch.equal(o, m) for o, m in zip(outs, msgs, strict=True))
        assert torch.equal(out_vec, vec)
        assert a.bytes_sent == sum(4 + 8 + m.numel() for m in msgs) + 4 + 8 + vec.numel() * 8
    finally:
        a.close()
        b.close()


def test_a_peer_that_leaves_fails_the_pending_receives_at_once() -> None:
    a, b = _pair()
    work = b.irecv(torch.empty(8, dtype=torch.uint8), 0)
    since = time.monotonic()
    a.close()
    with pytest.raises(RuntimeError, match=r"closed by the peer|connection broke"):
        work.wait(WAIT)
    assert time.monotonic() - since < 5
    b.close()


def test_a_wait_that_times_out_ends_the_link_for_both_ends() -> None:
    a, b = _pair()
    mine = a.irecv(torch.empty(8, dtype=torch.uint8), 0)
    theirs = b.irecv(torch.empty(8, dtype=torch.uint8), 0)
    with pytest.raises(RuntimeError, match="timed out waiting for rank 1"):
        mine.wait(datetime.timedelta(seconds=0.2))
    with pytest.raises(RuntimeError, match=r"closed by the peer|connection broke"):
        theirs.wait(WAIT)   # the peer hears of it now, not after its own timeout
    a.close()
    b.close()


def test_a_message_of_the_wrong_size_fails_the_link_naming_both_sizes() -> None:
    a, b = _pair()
    a.isend(torch.zeros(9, dtype=torch.uint8), 0)
    with pytest.raises(RuntimeError, match="a message of 9 bytes from rank 0 where 8"):
        b.irecv(torch.empty(8, dtype=torch.uint8), 0).wait(WAIT)
    a.close()
    b.close()


def test_a_frame_length_out_of_range_is_refused_before_reading_it() -> None:
    a, b = socket.socketpair()
    b.settimeout(5)
    a.sendall(struct.pack("!I", MAX_FRAME + 1))
    with pytest.raises(FrameError, match="not a link's frame"):
        recv_frame(b, Opener())
    a.close()
    b.close()
