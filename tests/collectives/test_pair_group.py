"""A gossip group whose links are groups of two over the rendezvous
(:class:`~qcomm.collectives.gloo.pair_group.PairGroup`): bad arguments are named, it contacts
nothing until a link opens, and every collective is refused with a named error (its members
change while the job runs), and a link whose other end dials after this end gave up fails on
both ends without taking the process down. Links over it are tested as processes in
``test_join_processes.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qcomm.collectives.gloo.pair_group import PairGroup, gloo_devices

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    (("nowhere", 0, 3), {}, "rendezvous must be 'HOST:PORT'"),
    (("127.0.0.1:0", 0, 3), {}, "rendezvous must be 'HOST:PORT'"),
    (("127.0.0.1:29400", 3, 3), {}, "member"),
    (("127.0.0.1:29400", -1, 3), {}, "member"),
    (("127.0.0.1:29400", 0, 0), {}, "size"),
    (("127.0.0.1:29400", 0, 3), {"timeout_s": 0}, "timeout"),
])
def test_bad_arguments_are_named(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        PairGroup(*args, **kwargs)


def test_it_contacts_nothing_until_a_link_opens_and_refuses_every_collective() -> None:
    g = PairGroup("127.0.0.1:1", 1, 3)   # nothing listens there: nothing is asked of it
    assert (g.rank, g.size, g.ranks) == (1, 3, [0, 1, 2])
    t = torch.zeros(4)
    calls = [lambda: g.all_reduce(t), lambda: g.all_reduce_future(t),
             lambda: g.all_gather_flat(torch.zeros(12), t),
             lambda: g.all_to_all_single(torch.zeros(3), torch.zeros(3)), g.barrier,
             lambda: g.transport([0], stats=None, level="inter")]
    for call in calls:
        with pytest.raises(NotImplementedError, match="over a PairGroup: its members change"):
            call()


def test_links_use_the_interfaces_gloo_socket_ifname_names(monkeypatch) -> None:
    """A link's devices follow GLOO_SOCKET_IFNAME as torch's own Gloo groups do: an interface
    that does not exist fails there (so the variable is read), a comma list gives a device per
    interface, and without it the default device. (Found on the emulated cluster: a link built
    with explicit options offered 127.0.0.1, where the host name resolves, to the other
    nodes.)"""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "qcomm-no-such-if0")
    with pytest.raises(RuntimeError, match="qcomm-no-such-if0"):
        gloo_devices()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert len(gloo_devices()) == 2
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert len(gloo_devices()) == 1


def test_a_link_whose_other_end_dials_after_this_end_gave_up_fails_without_a_crash() -> None:
    """The two ends of a link in one process (:mod:`qcomm.testing.late_link`), the dialling
    one 7 s late: the other gives up at 5 s (Gloo's "Connect timeout", five times the link's
    1 s timeout) and its caller holds the error 6 s, as a thread descheduled on loaded cores
    would, while the late end dials. Both ends fail with a RuntimeError (what the gossip's
    streams name a lost peer) and the process lives on: the failed link's Gloo device went
    with the failed call and refused the late end. While a frame of the error kept the
    device, it handed the late connection to the pair Gloo had freed: SIGSEGV, every time
    (seen as SIGABRT in a 16-process run)."""
    proc = subprocess.run([sys.executable, "-m", "qcomm.testing.late_link", "--timeout-s", "1",
                           "--late-s", "7", "--hold-s", "6"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    ends = sorted(proc.stdout.splitlines())
    assert [e.split(":")[0] for e in ends] == ["member 0", "member 1"], proc.stdout
    assert all(": failed: " in e for e in ends), proc.stdout
    assert any("Connect timeout" in e for e in ends), proc.stdout   # the end that gave up
