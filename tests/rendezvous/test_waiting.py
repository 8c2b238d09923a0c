"""A wait at the rendezvous says what it waits for (:mod:`qcomm.rendezvous.waiting`), and the
refusals kept there (:mod:`qcomm.rendezvous.refusals`) end waits and restarts that cannot
succeed. On an in-process store; in processes: tests/rendezvous/test_seat.py (seats) and
tests/rendezvous/test_refused.py (a node refused under torchrun)."""

from __future__ import annotations

import datetime
import logging
import threading

import pytest
import torch.distributed as dist

from qcomm.rendezvous.refusals import record_refusal, refusal_of_member, refusal_of_this_run
from qcomm.rendezvous.shared_client import SharedClient
from qcomm.rendezvous.waiting import WaitAbandoned, abandon_when, wait_keys

WHERE = "10.0.0.9:29400"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qcomm"]


def test_a_wait_names_what_is_still_missing_every_slice_then_times_out(
        caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    keys = {"a": "node 1 to take its seat", "b": "node 2 to take its seat"}
    threading.Timer(0.3, store.set, ("a", "1")).start()
    with caplog.at_level(logging.WARNING, "qcomm"), \
            pytest.raises(TimeoutError, match=rf"node 0 waited 1.2 s at the rendezvous {WHERE} "
                                              r"for node 2 to take its seat$"):
        wait_keys(store, keys, 1.2, WHERE, who="node 0", every_s=0.2)
    lines = _lines(caplog)
    assert lines[0].startswith("qcomm: node 0 waits for node 1 to take its seat; node 2 to "
                               f"take its seat at the rendezvous {WHERE}; "), lines
    assert lines[-1].startswith(f"qcomm: node 0 waits for node 2 to take its seat at the "
                                f"rendezvous {WHERE}; "), lines   # node 1 came
    assert lines[-1].endswith(" s left of 1.2"), lines
    assert 3 <= len(lines) <= 6, lines


def test_a_wait_on_a_tcp_store_prints_no_warnings_of_its_own(capfd: pytest.CaptureFixture
                                                            ) -> None:
    """A TCPStore wait that times out prints C++ warnings each time: the keys are polled."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    with pytest.raises(TimeoutError):
        wait_keys(store, {"a": "node 1"}, 0.6, WHERE, every_s=0.2)
    out, err = capfd.readouterr()
    assert "socket" not in out + err and "timed out" not in out + err, out + err


def test_a_wait_that_is_met_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    store.set("a", "1")
    with caplog.at_level(logging.WARNING, "qcomm"):
        wait_keys(store, {"a": "node 1"}, 5.0, WHERE, every_s=0.2)
    assert _lines(caplog) == []


def test_a_check_ends_the_wait_with_its_error() -> None:
    store = dist.HashStore()

    def refused() -> None:
        raise RuntimeError("member 1 was refused")

    with pytest.raises(RuntimeError, match="member 1 was refused"):
        wait_keys(store, {"a": "member 1"}, 30.0, WHERE, every_s=0.1, check=refused)


def test_a_wait_abandoned_from_another_thread_ends_at_its_next_poll() -> None:
    """A link being made waits here and in Gloo's rendezvous (a SharedClient ``get``); once
    its streams close, both waits end with WaitAbandoned (a RuntimeError), not at their
    bounds; outside the block, waits are not abandoned; the other keys of the message."""
    store = dist.HashStore()
    closing = threading.Event()
    threading.Timer(0.3, closing.set).start()
    with abandon_when(closing.is_set, "link to rank 1"):
        with pytest.raises(WaitAbandoned, match="link to rank 1: abandoned"):
            wait_keys(store, {"a": "member 1"}, 30.0, WHERE)
        with pytest.raises(RuntimeError, match="abandoned"):
            SharedClient(store, 30.0).get("b")
    store.set("c", "1")
    wait_keys(store, {"c": "member 1"}, 5.0, WHERE)   # closing is set, but not this wait's


@pytest.mark.parametrize(("name", "kwargs"), [("timeout_s", {"timeout_s": 0}),
                                              ("every_s", {"every_s": -1.0}),
                                              ("poll_s", {"poll_s": 0.0})])
def test_bad_times_are_named(name: str, kwargs: dict) -> None:
    args = {"timeout_s": 1.0, **kwargs}
    with pytest.raises(ValueError, match=rf"{name} must be"):
        wait_keys(dist.HashStore(), {"a": "x"}, args.pop("timeout_s"), WHERE, **args)


def test_a_refusal_is_kept_by_member_and_incarnation_and_by_torchrun_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    for var, value in (("TORCHELASTIC_RUN_ID", "run-a"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    assert refusal_of_this_run(store) is None
    record_refusal(store, 1, 2, "this node's bits is 2 but the running job's is 4")
    assert refusal_of_member(store, 1, 2) == "this node's bits is 2 but the running job's is 4"
    assert refusal_of_member(store, 1, 3) is None        # the same seat, a later start
    assert refusal_of_this_run(store) == refusal_of_member(store, 1, 2)   # its restarts
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")   # a new torchrun: not refused
    assert refusal_of_this_run(store) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")            # no torchrun: nothing to restart
    assert refusal_of_this_run(store) is None
