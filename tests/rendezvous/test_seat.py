"""Seating a node through the rendezvous: bad input gets an error that names it, before any
process group exists (lone processes on localhost, each a node of one rank)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from qcomm.rendezvous import init_process_group, parse_address
from qcomm.testing.multiprocess import free_port
from tests.rendezvous.test_launch import ENV

SEAT = ("import sys; from qcomm.rendezvous import init_process_group; "
        "node = None if sys.argv[1] == '-' else int(sys.argv[1]); "
        "s = init_process_group(node_id=node, timeout_s=float(sys.argv[2])); "
        "print('seated', s.node, s.rank, s.world_size, flush=True)")


def _node(address: str, node_id: int | None, timeout_s: float = 20.0,
          **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SEAT, "-" if node_id is None else
                             str(node_id), str(timeout_s)],
                            env=dict(ENV, QCOMM_RENDEZVOUS=address, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=60)
    # a node that waits for the others says so every few seconds: not what is compared here
    waits = re.compile(r"^qcomm: node \d+ waits for .* at the rendezvous .*\n", re.M)
    return p.returncode, waits.sub("", out)


@pytest.mark.parametrize("address", ["", "host", "host:", ":29400", "host:0", "host:70000",
                                     "host:port", 29400])
def test_a_bad_address_is_named(address: object) -> None:
    with pytest.raises(ValueError, match=r"rendezvous must be 'HOST:PORT'"):
        parse_address(address)


def test_no_address_anywhere_says_where_to_put_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QCOMM_RENDEZVOUS", raising=False)
    with pytest.raises(ValueError, match="QCOMM_RENDEZVOUS is not set"):
        init_process_group()


def test_no_rendezvous_at_the_address_times_out_naming_it() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"no rendezvous at 127.0.0.1:{port} within 2 s"):
        init_process_group(f"127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_nodes_take_seats_in_order_of_arrival(rendezvous) -> None:
    address = rendezvous(2)
    first = _node(address, None)
    time.sleep(1.0)
    second = _node(address, None)
    assert _finish(first) == (0, "seated 0 0 2\n")
    assert _finish(second) == (0, "seated 1 1 2\n")


def test_a_seat_taken_is_refused_on_the_newcomer_only(rendezvous) -> None:
    address = rendezvous(2)
    first = _node(address, 0)
    time.sleep(1.0)
    code, out = _finish(_node(address, 0))
    assert code != 0 and "ValueError: node_id 0 is taken by another node of this job" in out
    third = _node(address, 1)  # the job still forms with the node that is not a duplicate
    assert _finish(first) == (0, "seated 0 0 2\n")
    assert _finish(third) == (0, "seated 1 1 2\n")


def test_a_full_job_refuses_one_more_node(rendezvous) -> None:
    address = rendezvous(1)
    assert _finish(_node(address, None)) == (0, "seated 0 0 1\n")
    code, out = _finish(_node(address, None))
    assert code != 0 and "every seat of this job's 1 nodes is taken" in out, out


def test_nodes_of_different_sizes_are_refused_naming_procs_per_node(rendezvous) -> None:
    address = rendezvous(2)
    small = _node(address, 0)
    # A node of two ranks as torchrun would start its first one.
    big = _node(address, 1, LOCAL_WORLD_SIZE="2", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="big")
    for p in (small, big):
        code, out = _finish(p)
        assert code != 0 and ("every node must run the same number of processes, but "
                              "procs_per_node by node = {0: 1, 1: 2}") in out, out


def test_a_node_that_never_comes_is_named_while_waited_for_then_a_timeout(rendezvous) -> None:
    address = rendezvous(2)
    p = _node(address, 0, timeout_s=7.0)
    out, _ = p.communicate(timeout=60)
    code = p.returncode
    # every few seconds the wait says what it waits for, where, and how long it has left
    assert re.search(rf"node 0 waits for node 1 of 2 to take its seat at the rendezvous "
                     rf"{address}; \d s left of 7", out), out
    assert code != 0 and (f"TimeoutError: node 0 waited 7 s at the rendezvous {address} for "
                          "node 1 of 2 to take its seat") in out, out


def test_a_node_of_several_ranks_without_torchrun_is_refused(rendezvous) -> None:
    code, out = _finish(_node(rendezvous(1), None, LOCAL_WORLD_SIZE="2", LOCAL_RANK="0"))
    assert code != 0 and "start each node with its own torchrun" in out, out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "nodes must be"),
    (["--nodes", "2", "--port", "0"], "port must be"),
    (["--nodes", "2", "--max-nodes", "1"], "max_nodes must be an int >= nodes (2)"),
    (["--nodes", "2", "--port", "29411", "--relay-port", "29411"],
     "--relay-port must differ from the rendezvous's port (29411), got 29411"),
    # an address of no interface here (TEST-NET-3): refused at once, where TCPStore's client
    # retried its connect for its whole timeout (54 s)
    (["--nodes", "2", "--host", "203.0.113.7"], "cannot listen on 203.0.113.7:29400"),
])
def test_the_rendezvous_refuses_bad_arguments(args: list[str], message: str) -> None:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "qcomm.rendezvous", *args], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert time.monotonic() - t0 < 25, "not refused at once"   # the interpreter and torch


def test_the_rendezvous_says_when_its_port_is_taken(rendezvous) -> None:
    port = rendezvous(1).rpartition(":")[2]
    done = subprocess.run([sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1",
                           "--port", port, "--nodes", "1"], env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, \
        done.stderr


def test_the_rendezvous_stops_cleanly_on_sigterm() -> None:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1",
                          "--port", str(port), "--nodes", "1"], env=ENV,
                         stdout=subprocess.PIPE, text=True)
    assert "listening" in p.stdout.readline()
    p.terminate()
    assert p.wait(timeout=10) == 0
