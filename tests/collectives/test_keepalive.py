"""Keepalives: a member that waits in a collective point (a drain, an exact sum) sends nothing
else, and its neighbours' streams would count it silent after ``timeout_s``; while it waits it
keeps them alive (:meth:`MessageStreams.keeping_alive`), and the keepalives are read by the
streams, never delivered as messages. Over Gloo (a pair of streams in this process) and in
memory, and wired into both wait-free gossips' waits."""

from __future__ import annotations

import time

import pytest
import torch

from qcomm.collectives.errors import PeerTimeoutError
from qcomm.collectives.gossip import WaitFreeGossip
from qcomm.collectives.gossip.membership import Membership
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.gossip.wait_free_message import RETIRE_ROUND, MessageLayout
from qcomm.collectives.memory import MemoryWorld
from qcomm.compress import QuantSpec

from .test_gloo_streams import _linked_pair, _message, _take_all

NUMEL = 1024
SPEC = QuantSpec(4, 128, "stochastic")
KEEPALIVE, GOODBYE = 254, 255


def _ends(message: torch.Tensor, sender: int) -> str | None:
    return {GOODBYE: "goodbye", KEEPALIVE: "keepalive"}.get(int(message[0]))


def test_gloo_ends_that_keep_alive_are_not_silent_and_their_keepalives_are_not_delivered(
        ) -> None:
    """Both ends wait three silence bounds keeping alive: neither stream fails, nothing is
    delivered, and a message sent after arrives alone. Then only member 1 keeps alive for
    as long: its stream from member 0 fails as silent."""
    timeout_s = 1.0
    ends, _rendezvous = _linked_pair(timeout_s=timeout_s, max_backlog=8, stream_end=_ends)
    try:
        assert all(s.wait_made(20) for s in ends)
        keepalive = _message(KEEPALIVE)
        with ends[0].keeping_alive(keepalive), ends[1].keeping_alive(keepalive):
            time.sleep(3 * timeout_s)
            assert [s.take(0) for s in ends] == [([], None), ([], None)]
        for m, s in enumerate(ends):
            assert s.send(_message(10 + m)) == []
        assert _take_all(ends[0], 0, 1, timeout_s=5) == [11]
        assert _take_all(ends[1], 0, 1, timeout_s=5) == [10]

        # the control: member 0 silent (member 1 alone keeps alive) is timed out by member 1
        # (which ends their link, a Gloo group of two, in both directions)
        with ends[1].keeping_alive(keepalive):
            time.sleep(3 * timeout_s)
            msgs, err = ends[1].take(0)
        assert msgs == [] and isinstance(err, PeerTimeoutError), err
        assert err.peers == [0]
    finally:
        for s in ends:
            s.close(_message(GOODBYE))


def test_memory_streams_kept_alive_are_not_silent_until_the_keepalives_stop() -> None:
    timeout_s = 0.5
    world = MemoryWorld(2)
    streams = [world.group([0, 1], m).streams([1 - m], nbytes=8, max_backlog=4,
                                              timeout_s=timeout_s, stream_end=_ends,
                                              stats=None, level="inter")
               for m in (0, 1)]
    with streams[1].keeping_alive(torch.zeros(8, dtype=torch.uint8)):
        time.sleep(3 * timeout_s)
        assert streams[0].take(0) == ([], None)
    time.sleep(1.5 * timeout_s)
    msgs, err = streams[0].take(0)
    assert msgs == [] and isinstance(err, PeerTimeoutError), err


def test_a_keepalive_is_told_from_the_other_control_messages_and_by_its_sender() -> None:
    """Member 1's keepalive is "keepalive" from member 1 only (sealed by its sender); its
    goodbye and retire keep their meanings; a keepalive is not a goodbye."""
    def membership(m: int) -> Membership:
        return Membership("ring", "uniform", [0, 1, 2], m, NUMEL, MessageLayout(16, 3, m),
                          streams=lambda: None)

    receiver, sender = membership(0), membership(1)
    keepalive = sender.layout.keepalive()
    assert receiver.stream_end(keepalive, 1) == "keepalive"
    assert receiver.stream_end(keepalive, 2) is None   # not sealed by member 2
    assert receiver.stream_end(sender.goodbye(), 1) == "goodbye"
    assert receiver.stream_end(sender.layout.control(RETIRE_ROUND), 1) == "last"
    assert receiver.stream_end(sender.marker(), 1) is None


def _drain_then_sum(gossip: str):
    """Two members as threads, timeout_s 2: member 1 takes 1.2 s (within the bound) to reach
    the drain, then as long between the drain and the sum, while member 0 waits in each.
    Returns, per wait, whether member 0's keepalives reached member 1 meanwhile (one after
    the first, at the start of the wait)."""
    timeout_s, late_s = 2.0, 1.2
    world = MemoryWorld(2, timeout_s=30)

    def body(rank: int) -> dict | None:
        group = world.group([0, 1], rank)
        if gossip == "ring":
            g = WaitFreeGossip([0, 1], group, NUMEL, spec=SPEC, timeout_s=timeout_s)
        else:
            g = OnePeerWaitFree([0, 1], group, NUMEL, spec=SPEC, graph="one-peer-exp",
                                timeout_s=timeout_s)
        x = torch.full((NUMEL,), float(rank))
        for _ in range(4):
            g.prepare()
            g.end_step(x)
        heard = {}
        if rank == 1:
            t0 = time.monotonic()
            time.sleep(late_s)
            heard["drain"] = group.mailboxes.touched(0, 1) - t0
        g.drain()
        if rank == 1:
            t0 = time.monotonic()
            time.sleep(late_s)
            heard["sum"] = group.mailboxes.touched(0, 1) - t0
        total, count = g.survivors_sum(x)
        g.close()
        return {"heard": heard, "count": count, "total": total}

    return world.run(body, timeout_s=60)


@pytest.mark.parametrize("gossip", ["ring", "one-peer"])
def test_a_member_waiting_in_the_drain_and_the_sum_keeps_its_links_alive(gossip: str) -> None:
    res = _drain_then_sum(gossip)
    # a keepalive a period (0.5 s) or more into each wait, not only the one at its start
    assert res[1]["heard"]["drain"] > 0.4 and res[1]["heard"]["sum"] > 0.4, res[1]["heard"]
    assert res[0]["count"] == res[1]["count"] == 2
    assert torch.equal(res[0]["total"], res[1]["total"])
