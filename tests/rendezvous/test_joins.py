"""Joins announced through the rendezvous (:mod:`qcomm.rendezvous.joins`): the running members'
watcher sees each join once and in order, the first state offered is the one the joiner takes,
a joiner that gets none fails with a named error in its bound, and a rendezvous that is down
stops nothing (the watcher warns once and picks the joins up when it is back). The rendezvous
runs in a thread of this process."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from qcomm.rendezvous.joins import (
    STATE_PART_BYTES,
    JoinWatcher,
    _state_key,
    announce,
    await_state,
    offer_state,
)
from qcomm.testing.multiprocess import free_port
from tests.rendezvous_thread import rendezvous_in_thread, serve_in_thread


@pytest.fixture
def rendezvous() -> Iterator[tuple[int, dist.Store]]:
    with rendezvous_in_thread() as served:
        yield served


def _collect(watcher: JoinWatcher, count: int, timeout_s: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += watcher.new()
        time.sleep(0.02)
    return got


def test_the_watcher_sees_each_join_once_in_order(rendezvous) -> None:
    port, store = rendezvous
    watcher = JoinWatcher("127.0.0.1", port, poll_s=0.02)
    try:
        assert announce(store, 2, 2) == 1
        assert announce(store, 0, 3) == 2
        assert _collect(watcher, 2) == [(1, 2, 2), (2, 0, 3)]
        time.sleep(0.1)
        assert watcher.new() == []   # nothing twice
        # a joiner's own watcher starts after its own join
        late = JoinWatcher("127.0.0.1", port, poll_s=0.02, seen=2)
        assert announce(store, 1, 2) == 3
        assert _collect(late, 1) == [(3, 1, 2)]
        late.close()
    finally:
        watcher.close()


def test_the_first_state_offered_is_the_one_taken(rendezvous) -> None:
    _, store = rendezvous
    seq = announce(store, 1, 2)
    assert offer_state(store, seq, b"first")
    assert not offer_state(store, seq, b"second")
    assert await_state(store, seq, 5) == b"first"


def test_a_joiner_that_gets_no_state_fails_in_its_bound(rendezvous) -> None:
    _, store = rendezvous
    seq = announce(store, 1, 2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no running member handed this joiner its state "
                                           r"within 0.5 s \(join 1\)"):
        await_state(store, seq, 0.5)
    assert time.monotonic() - t0 < 5


def test_a_joiner_waiting_for_its_state_says_so(rendezvous,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _, store = rendezvous
    seq = announce(store, 1, 2)
    with caplog.at_level(logging.WARNING, "qcomm"), pytest.raises(TimeoutError):
        await_state(store, seq, 5.5, "10.0.0.9:29400")
    assert any(r.getMessage().startswith(
        f"qcomm: this joining node waits for a running node to hand it its state (join {seq}) "
        "at the rendezvous 10.0.0.9:29400; ") for r in caplog.records), caplog.text


def test_a_rendezvous_that_is_down_stops_nothing_and_joins_wait_for_it(caplog) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="qcomm")
    watcher = JoinWatcher("127.0.0.1", port, poll_s=0.05)
    try:
        t0 = time.monotonic()
        assert watcher.new() == []            # never blocks its caller
        assert time.monotonic() - t0 < 0.1
        deadline = time.monotonic() + 15
        while "does not answer" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert caplog.text.count("does not answer") == 1   # once, however many polls fail
        t, stop = serve_in_thread(port)        # back
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=5))
        announce(store, 2, 2)
        assert _collect(watcher, 1, 20) == [(1, 2, 2)]
        assert "answers again" in caplog.text
        stop.set()
        t.join(5)
    finally:
        watcher.close()


def test_a_state_larger_than_a_store_value_goes_in_parts_and_leaves_nothing(rendezvous) -> None:
    """torch's TCPStore server refuses a value over 8 MiB (and drops the connection that sent
    it): a 20 MiB state (a model of a few million parameters with its optimizer state and the
    gossip's copies) arrives whole, byte for byte; an offer not taken and the parts of the one
    taken are deleted from the rendezvous."""
    _, store = rendezvous
    seq = announce(store, 1, 2)
    state = bytes(range(256)) * (20 * 4096) + b"tail"   # 20 MiB + 4 bytes
    assert len(state) > 2 * STATE_PART_BYTES
    assert offer_state(store, seq, state)
    keys_before = store.num_keys()
    assert not offer_state(store, seq, b"x" * (STATE_PART_BYTES + 1))  # a second donor
    assert store.num_keys() == keys_before   # its parts are gone again
    assert await_state(store, seq, 5) == state
    parts = -(-len(state) // STATE_PART_BYTES)
    assert store.num_keys() == keys_before - parts


def test_an_empty_state_is_offered_and_taken(rendezvous) -> None:
    _, store = rendezvous
    seq = announce(store, 1, 2)
    assert offer_state(store, seq, b"")
    assert await_state(store, seq, 5) == b""


def test_a_state_whose_parts_do_not_add_up_is_refused_by_size(rendezvous) -> None:
    """A part cut short in the rendezvous (a donor or a store that lost bytes) is no state to
    start from: the joiner gets a ValueError naming both sizes, which its join vote handles as
    a failed join, rather than a model built from the wrong bytes."""
    _, store = rendezvous
    seq = announce(store, 1, 2)
    state = b"y" * (STATE_PART_BYTES + 10)
    assert offer_state(store, seq, state)
    offer = store.get(_state_key(seq)).decode().split(":")[0]
    store.set(f"{_state_key(seq)}/{offer}/1", b"short")   # 5 bytes instead of 10
    with pytest.raises(ValueError, match=rf"join {seq} is {STATE_PART_BYTES + 5} bytes, its "
                                         rf"offer said {STATE_PART_BYTES + 10}"):
        await_state(store, seq, 5)
