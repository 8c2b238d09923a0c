"""A link waits for a peer that is slow to start as long as the peer beats at the rendezvous,
and gives up one that does not (:mod:`qcomm.rendezvous.heartbeat`), in one process: a TCPStore
for the rendezvous and both ends of a :class:`~qcomm.collectives.gloo.pair_group.PairGroup`
link on threads.

Found under load: a node whose torch import took longer than ``timeout_s`` (20 s) after its
neighbours' was dropped before it arrived, and the job split."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.gloo.pair_group import PairGroup
from qcomm.rendezvous.heartbeat import BEAT_EVERY_S, PulseWatch, start_heartbeat
from qcomm.rendezvous.seat import claim_incarnation
from qcomm.testing.multiprocess import free_port

SILENCE_S = 1.0   # the links' timeout_s: far shorter than the late end's start


@pytest.fixture
def rendezvous():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    yield f"127.0.0.1:{port}", store


def _open_late(group: PairGroup, store: dist.Store, delay_s: float, *, beat: bool,
               out: dict) -> threading.Thread:
    """Member 1 takes its seat (and beats, if ``beat``) now, and opens its link to member 0
    ``delay_s`` later, on a thread; what it got goes to ``out``."""
    incarnation = claim_incarnation(store, 1)
    if beat:
        start_heartbeat(group.host, group.port, 1, incarnation, 30.0)

    def late() -> None:
        time.sleep(delay_s)
        try:
            out["channel"] = group.connect(0, 0)
        except RuntimeError as e:
            out["error"] = e

    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    return thread


def test_a_peer_slow_to_open_its_link_is_waited_for_while_it_beats(rendezvous) -> None:
    address, store = rendezvous
    first = PairGroup(address, 0, 2, timeout_s=SILENCE_S, join_timeout_s=60)
    late = PairGroup(address, 1, 2, timeout_s=SILENCE_S, join_timeout_s=60)
    claim_incarnation(store, 0)
    got: dict = {}
    thread = _open_late(late, store, 6 * SILENCE_S, beat=True, out=got)
    started = time.monotonic()
    channel = first.connect(1, 1)          # waits past its silence bound: the peer beats
    waited_s = time.monotonic() - started
    thread.join(timeout=60)
    assert "error" not in got and waited_s >= 5 * SILENCE_S, (got, waited_s)
    # the link works: a message each way
    a, b = torch.arange(4.0), torch.zeros(4)
    send, recv = channel.isend(a, 0), got["channel"].irecv(b, 0)
    send.wait(), recv.wait()
    assert torch.equal(a, b)
    channel.close(), got["channel"].close()


def test_a_peer_that_does_not_beat_is_given_up_after_the_silence_bound(rendezvous) -> None:
    address, store = rendezvous
    first = PairGroup(address, 0, 2, timeout_s=SILENCE_S, join_timeout_s=60)
    claim_incarnation(store, 0)
    claim_incarnation(store, 1)            # started, then died before its first beat
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(incarnation 1\) never beat at the "
                                           r"rendezvous .*lost before it opened its link"):
        first.connect(1, 1)
    # given up at the first look after the silence bound, not at the start bound
    assert time.monotonic() - started < 20


def test_without_a_start_bound_the_silence_bound_ends_the_wait(rendezvous) -> None:
    """Members that do not beat (no ``join_timeout_s``): the wait is ``timeout_s``, as for a
    group made by hand."""
    address, store = rendezvous
    first = PairGroup(address, 0, 2, timeout_s=SILENCE_S)
    claim_incarnation(store, 0)
    claim_incarnation(store, 1)
    with pytest.raises(RuntimeError, match=r"waited 1 s at the rendezvous .* to open its link"):
        first.connect(1, 1)


def test_a_beat_that_stops_is_seen_after_the_silence_bound(rendezvous) -> None:
    _, store = rendezvous
    store.add("qcomm/pulse/3/2", 5)
    watch = PulseWatch(store, 3, 2, silence_s=2 * BEAT_EVERY_S)
    watch.check()                          # just made: not silent yet
    store.add("qcomm/pulse/3/2", 1)
    time.sleep(1.5 * BEAT_EVERY_S)
    watch.check()                          # it moved since the last look
    time.sleep(2.5 * BEAT_EVERY_S)
    with pytest.raises(RuntimeError, match=r"rank 3 \(incarnation 2\) stopped beating \d+ s "
                                           r"ago"):
        watch.check()


def test_a_bad_start_bound_is_named() -> None:
    with pytest.raises(ValueError, match="join_timeout_s"):
        PairGroup("127.0.0.1:29400", 0, 2, join_timeout_s=0)


def test_init_node_names_a_bad_start_bound_before_any_connection() -> None:
    from qcomm.rendezvous import init_node, linked_seat

    with pytest.raises(ValueError, match="join_timeout_s must be"):
        init_node("127.0.0.1:1", join_timeout_s=-1)
    assert linked_seat() is None


# ---------------------------------------------------------------------------------------------
# the starting nodes begin together (qcomm.rendezvous.start)

def _start(store, member: int, starting: int, **kw) -> tuple[set[int], float]:
    from qcomm.rendezvous.start import start_together

    began = time.monotonic()
    args = dict(rail="rail0", ranks=list(range(starting)), join_timeout_s=60,
                silence_s=SILENCE_S, where="here", who=f"rank {member}", every_s=0.5)
    gone = start_together(store, member, starting, **{**args, **kw})
    return gone, time.monotonic() - began


def test_a_starting_member_waits_for_one_that_sets_up_late_while_it_beats(rendezvous) -> None:
    address, store = rendezvous
    host, port = address.split(":")
    start_heartbeat(host, int(port), 1, claim_incarnation(store, 1), 30.0)
    late: dict = {}
    thread = threading.Thread(target=lambda: (time.sleep(4 * SILENCE_S),
                                              late.update(r=_start(store, 1, 2))))
    thread.start()
    gone, waited_s = _start(store, 0, 2)      # past its silence bound: member 1 beats
    thread.join(timeout=30)
    assert gone == set() and waited_s >= 3.5 * SILENCE_S, (gone, waited_s)
    assert late["r"][0] == set() and late["r"][1] < 2   # the last to come waits for nobody


def test_a_starting_member_is_given_up_when_refused_or_silent(rendezvous, caplog) -> None:
    from qcomm.rendezvous.refusals import record_refusal

    _, store = rendezvous
    claim_incarnation(store, 1)               # seated, died before its first beat
    record_refusal(store, 2, claim_incarnation(store, 2), "its bits is 2, the job's 4")
    gone, waited_s = _start(store, 0, 4, join_timeout_s=2 * SILENCE_S)   # 3 never seated
    assert gone == {1, 2, 3} and waited_s < 10, (gone, waited_s)
    text = caplog.text
    assert "starts without member 2 (rank 2): the job refused it (its bits is 2" in text, text
    assert "starts without member 1 (rank 1): rank 1 (incarnation 1) never beat" in text, text
    assert "starts without members [3] (ranks [3]): not set up within 2 s" in text, text


class _SlowStore:
    """A store whose second add takes ``add_s`` (a rendezvous held by a name lookup)."""

    def __init__(self, add_s: float) -> None:
        self.add_s, self.adds = add_s, 0
        self.slow_add_began = threading.Event()

    def add(self, key: str, value: int) -> int:
        self.adds += 1
        if self.adds == 2:
            self.slow_add_began.set()
            time.sleep(self.add_s)
        return self.adds


def test_stopping_waits_for_an_add_in_flight_up_to_the_stores_timeout(monkeypatch) -> None:
    """At exit the beat's thread must have left before the interpreter finalizes (one that
    comes back from the store's C++ add then aborts the process): ``stop`` waits for an add
    in flight that takes longer than 5 beats, the old bound, within the store's timeout."""
    from qcomm.rendezvous import heartbeat

    monkeypatch.setattr(heartbeat, "BEAT_EVERY_S", 0.05)   # 5 beats: 0.25 s
    store = _SlowStore(add_s=1.0)
    beat = heartbeat.Heartbeat(store, 1, 0, "nowhere:0", timeout_s=5.0)
    assert store.slow_add_began.wait(5)
    beat.stop()
    assert not beat.thread.is_alive() and store.adds == 2
