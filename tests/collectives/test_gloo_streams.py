"""Gloo streams finished one at a time (:meth:`MessageStreams.finish`), as the wait-free gossip
retires a link when a member joins between two others: the last message is delivered, nothing
follows it, the receiver thread of that stream leaves, and the other streams go on."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from qcomm.collectives.gloo.streams import GlooStreams
from qcomm.testing.multiprocess import run_world

NBYTES = 64


def _stream_end(message: torch.Tensor, sender: int) -> str | None:
    return "last" if int(message[0]) == 255 else None


def _message(value: int) -> torch.Tensor:
    return torch.full((NBYTES,), value, dtype=torch.uint8)


def _take_all(streams: GlooStreams, k: int, count: int, timeout_s: float = 30.0
              ) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        msgs, err = streams.take(k)
        assert err is None, err
        got += [int(m[0]) for m in msgs]
        if len(got) < count:
            streams.wait_any(0.5)
    return got


def _finish_both_ways(rank: int, world_size: int) -> dict:
    """Ranks 0, 1, 2 in a ring; 0 and 1 finish their stream to each other after three
    messages, then 0 keeps sending to 2 alone."""
    peers = [(rank + 1) % 3, (rank - 1) % 3]
    # a group of the streams' own (as the gossip has): the receives a finished stream leaves
    # posted must not meet the barrier's messages below (Gloo matches both by slot)
    group = dist.new_group([0, 1, 2])
    streams = GlooStreams(list(range(3)), group, rank, peers, NBYTES, max_backlog=8,
                          timeout_s=30.0, stream_end=_stream_end)
    receivers = lambda: sum(t.name.startswith(f"qcomm-recv-{rank}-")
                            for t in threading.enumerate())
    before = len(peers)   # one receiver thread per stream (one may be gone already)
    for v in (1, 2, 3):
        assert streams.send(_message(v)) == []
    out = {}
    if rank in (0, 1):
        k = peers.index(1 - rank)
        assert streams.finish(k, _message(255)) is None
        out["finished"] = _take_all(streams, k, 4)
        for _ in range(50):   # the receiver thread leaves after the last message
            if receivers() == before - 1:
                break
            time.sleep(0.1)
        out["receivers"] = (before, receivers())
        assert streams.send(_message(4)) == []  # only to the stream not finished
        streams.drop(k)
    if rank == 2:
        out["from0"] = _take_all(streams, peers.index(0), 4)
        out["from1"] = _take_all(streams, peers.index(1), 4)
    dist.barrier()   # no rank leaves (and closes its connections) before the others took all
    # with a goodbye (a last message), as the gossip closes: without one, each end waits for
    # its neighbours' for 10 s, then leaves receivers blocked in Gloo
    streams.close(_message(255))
    dist.destroy_process_group(group)  # frees the receives the finished streams left posted
    return out


def test_a_finished_stream_delivers_its_last_message_and_nothing_after_it() -> None:
    r0, r1, r2 = run_world(_finish_both_ways, 3, timeout_s=120)
    assert r0["finished"] == [1, 2, 3, 255]   # 1's three messages, then its last one
    assert r1["finished"] == [1, 2, 3, 255]
    # the receiver thread of the finished stream left; the other stream's stayed
    assert r0["receivers"][1] == r0["receivers"][0] - 1
    assert r1["receivers"][1] == r1["receivers"][0] - 1
    # member 2's streams went on: 0 and 1 sent their fourth message to it alone
    assert r2["from0"] == [1, 2, 3, 4]
    assert r2["from1"] == [1, 2, 3, 4]


def _goodbye(message: torch.Tensor, sender: int) -> str | None:
    return "goodbye" if int(message[0]) == 255 else None


def _seated_rendezvous() -> tuple[str, dist.Store]:
    """A rendezvous in this process where members 0 and 1 have taken their seats: its
    address and its store (keep it while the links run)."""
    import datetime

    from qcomm.rendezvous.seat import claim_incarnation
    from qcomm.testing.multiprocess import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    for m in (0, 1):
        claim_incarnation(master, m)
    return f"127.0.0.1:{port}", master


def _linked_pair(timeout_s: float, max_backlog: int, delay_s: float = 0.0,
                 stream_end=_stream_end) -> tuple[list[GlooStreams], dist.Store]:
    """Members 0 and 1's streams in this process over a rendezvous, each link made by a
    PairGroup (``delay_s`` late), and the rendezvous's store (keep it while they run)."""
    from qcomm.collectives.gloo.pair_group import PairGroup

    address, master = _seated_rendezvous()
    groups = [PairGroup(address, m, 2, timeout_s=20) for m in (0, 1)]

    def late(g: PairGroup):
        def connect(peer: int, rank: int):
            time.sleep(delay_s)
            return g.connect(peer, rank)
        return connect

    ends = [GlooStreams([0, 1], None, m, [1 - m], NBYTES, max_backlog=max_backlog,
                        timeout_s=timeout_s, stream_end=stream_end, connect=late(groups[m]))
            for m in (0, 1)]
    return ends, master


def test_two_ends_that_fill_their_backlogs_before_taking_each_others_hello_go_on() -> None:
    """Each end sends what a new link's hello is (a message, then a vector that the other
    end's caller takes once it reads that message) and then more than a backlog of messages, and
    neither takes anything meanwhile: as two members do whose link was made only after both
    had stepped past their backlog. Every send goes through (the other end's receiver thread
    holds them), then each takes the other's messages and vector. With the vector confirmed
    in line, the messages behind it waited for the other end's caller, which waited in its
    own send for room: both ends dropped each other after half the silence bound (found in
    a join on the suite's load, both ends "max_backlog=64 messages not taken")."""
    backlog = 8
    ends, _rendezvous = _linked_pair(timeout_s=4.0, max_backlog=backlog)
    try:
        assert all(s.wait_made(20) for s in ends)
        errors: dict[int, list] = {}

        def hello_then_backlog(m: int) -> None:
            s = ends[m]
            errs = [s.send_to(0, _message(100 + m))]
            s.send_vector(0, torch.full((4,), float(m)))
            errs += [s.send_to(0, _message(v)) for v in range(backlog + 1)]
            errors[m] = errs

        senders = [threading.Thread(target=hello_then_backlog, args=(m,), daemon=True)
                   for m in (0, 1)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(15)
        assert errors == {0: [None] * (backlog + 2), 1: [None] * (backlog + 2)}
        for m, s in enumerate(ends):
            assert _take_all(s, 0, 2 + backlog, timeout_s=10) == [101 - m,
                                                                 *range(backlog + 1)]
            got = torch.zeros(4)
            assert s.recv_vector(0, got, 5.0) is None
            assert torch.equal(got, torch.full((4,), float(1 - m)))
    finally:
        for s in ends:
            s.close()


def test_a_full_backlog_no_one_took_still_hears_the_goodbye_at_close() -> None:
    """Member 1 sends a backlog's worth that member 0 never takes (a faster neighbour, at the
    end of a run), then both close with a goodbye: each end hears the other's and returns
    at once. Member 0's receiver thread used to wait for room in its full backlog, so the
    goodbye was never received and both closes waited out their bound (10 s) for it."""
    backlog = 4
    ends, _rendezvous = _linked_pair(timeout_s=20.0, max_backlog=backlog, stream_end=_goodbye)
    try:
        assert all(s.wait_made(20) for s in ends)
        assert [ends[1].send_to(0, _message(v)) for v in range(backlog)] == [None] * backlog
        deadline = time.monotonic() + 10
        while len(ends[0]._links[0].ready) < backlog and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ends[0]._links[0].ready) == backlog   # member 0's backlog is full
        took: dict[int, float] = {}

        def close(m: int) -> None:
            t0 = time.monotonic()
            ends[m].close(_message(255))
            took[m] = time.monotonic() - t0

        closers = [threading.Thread(target=close, args=(m,), daemon=True) for m in (0, 1)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(30)
        assert ends[0].ended(0) and ends[1].ended(0)   # each heard the other's goodbye
        assert max(took.values()) < 5.0, took          # not the 10 s bound of the wait
    finally:
        for s in ends:
            s.close()


def test_an_end_the_caller_has_seen_wakes_its_waits_no_more() -> None:
    """Member 1 says goodbye; member 0's wait_any returns at once for the ended stream, as
    long as the caller does not say it knows (``known_ended``): then only a message or a
    failure ends the wait (a drain beside a neighbour that left used to spin on it)."""
    ends, _rendezvous = _linked_pair(timeout_s=20.0, max_backlog=8, stream_end=_goodbye)
    try:
        assert all(s.wait_made(20) for s in ends)
        ends[1].close(_message(255))
        deadline = time.monotonic() + 10
        while not ends[0].ended(0) and time.monotonic() < deadline:
            ends[0].take(0)
            ends[0].wait_any(0.1)
        assert ends[0].ended_now() == {0}
        t0 = time.monotonic()
        ends[0].wait_any(5.0)
        assert time.monotonic() - t0 < 1.0            # an end wakes it
        t0 = time.monotonic()
        ends[0].wait_any(0.5, known_ended=ends[0].ended_now())
        assert time.monotonic() - t0 >= 0.45          # a known one does not
    finally:
        for s in ends:
            s.close()


def test_closing_abandons_a_link_whose_other_end_never_came() -> None:
    """Member 0's stream to member 1, who took its seat but never opens the link (refused, or
    dead before it): close() waits for it as for a goodbye (the streams' bound, here 2 s),
    then abandons it, and the link's thread has left its wait in the store when close()
    returns. It used to wait on to the link's own bound (here 20 s, a job's start bound:
    minutes), and a daemon thread still inside torch's store when the interpreter exits
    aborts the process after a run that had finished (seen in a rejoin test)."""
    from qcomm.collectives.gloo.pair_group import PairGroup

    address, _rendezvous = _seated_rendezvous()
    group = PairGroup(address, 0, 2, timeout_s=20)
    streams = GlooStreams([0, 1], None, 0, [1], NBYTES, max_backlog=8, timeout_s=2.0,
                          stream_end=_goodbye, connect=group.connect)
    assert not streams.wait_made(0.5)   # waiting in the store for member 1
    receiver = streams._links[0].receiver
    t0 = time.monotonic()
    streams.close(_message(255))
    took = time.monotonic() - t0
    assert not receiver.is_alive()
    assert took < 10.0, took   # the 2 s bound and the leaving, not the link's 20 s


def test_a_link_slow_to_make_is_waited_for_and_its_silence_counts_from_when_it_was_made(
        ) -> None:
    """Two members' streams in one process over a rendezvous, each link made 1.5 s late with a
    silence bound of 1 s (a busy rendezvous): ``wait_made`` says the links are not made, then
    that they are; once made, a message sent at once arrives and neither end fails. The
    silence used to count from the stream's construction: a link made after the bound timed
    out at once, and both ends dropped each other with no message carried."""
    ends, _rendezvous = _linked_pair(timeout_s=1.0, max_backlog=8, delay_s=1.5)
    try:
        assert not ends[0].wait_made(0.3)
        assert all(s.wait_made(20) for s in ends)
        for m, s in enumerate(ends):
            assert s.send(_message(10 + m)) == []
        assert _take_all(ends[0], 0, 1, timeout_s=5) == [11]
        assert _take_all(ends[1], 0, 1, timeout_s=5) == [10]
    finally:
        for s in ends:
            s.close()


def _silent_member_in_a_ring(rank: int, world_size: int) -> dict | None:
    """Ranks 0, 1, 2 in a ring over the default group (what the gossip makes over a
    torch.distributed group: each link a group of its own); rank 2 stops once every link
    carried a message. Ranks 0 and 1 go on sending to each other (a message every 0.1 s, as
    steps would) until each finds rank 2 silent, drop it, and send five more."""
    import os
    import signal

    from qcomm.collectives.torch_group import TorchGroup

    peers = [(rank + 1) % 3, (rank - 1) % 3]
    streams = TorchGroup(None).streams(peers, nbytes=NBYTES, max_backlog=64, timeout_s=2.0,
                                       stream_end=_stream_end, stats=None, level="inter")
    assert streams.send(_message(rank)) == []
    silent, live = (peers.index(2), 1 - peers.index(2)) if rank != 2 else (0, 1)
    got: list[int] = []
    for k, peer in enumerate(peers):   # every link made and carrying
        first = _take_all(streams, k, 1)
        assert first[0] == peer, first
        if k == live:   # a live neighbour may already have sent more
            got += first[1:]
    dist.barrier()   # every first message taken: rank 2's too, by both its neighbours
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)   # alive, silent, its sockets open
    deadline = time.monotonic() + 30
    while (err := streams.take(silent)[1]) is None and time.monotonic() < deadline:
        assert streams.send_to(live, _message(10)) is None
        msgs, live_err = streams.take(live)
        assert live_err is None, live_err
        got += [int(m[0]) for m in msgs]
        time.sleep(0.1)
    streams.drop(silent)
    for i in range(5):
        assert (sent := streams.send(_message(20 + i))) == [], sent
    while len([v for v in got if v >= 20]) < 5 and time.monotonic() < deadline:
        msgs, live_err = streams.take(live)
        assert live_err is None, live_err
        got += [int(m[0]) for m in msgs]
        streams.wait_any(0.5)
    streams.close()
    return {"silent": (type(err).__name__, err.peers if err else None), "got": got}


def test_a_silent_member_fails_its_links_only() -> None:
    """Gloo closes every connection of a group when one of its waits times out: on the one
    group of all members, rank 0's wait on the silent rank 2 cut its link to rank 1, which
    then saw rank 0 as lost. Each link on a group of its own fails alone."""
    res = run_world(_silent_member_in_a_ring, 3, timeout_s=120, allow_exit={2})
    for rank in (0, 1):
        assert res[rank]["silent"] == ("PeerTimeoutError", [2]), res[rank]
        # what the other sent while it waited, then its five after the drop, all in order
        got = res[rank]["got"]
        assert got[-5:] == list(range(20, 25)) and set(got[:-5]) <= {10}, res[rank]


def test_a_group_made_by_hand_keeps_point_to_point_on_itself() -> None:
    """A process group torch.distributed did not make has no store to make links over: the
    streams then move on the group itself (no ``connect``)."""
    import datetime

    from qcomm.collectives.gloo.link_groups import link_connect

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=10)
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, opts)
    assert link_connect(group, 0) is None
