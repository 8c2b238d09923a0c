"""The guide's recipe for nodes at different sites ("Across sites"), as processes on localhost:
a rendezvous and one torchrun per node (examples/train_charlm.py, a tiny model), every node with
the job token, nodes 0 and 1 each accepting its links on one port of its own
(``QCOMM_LISTEN``), node 2 on none (behind a NAT: it dials). Node 1's worker is killed and
restarted by its torchrun: it rejoins over the same kind of links, its state sealed with the
token, and the three end with one model."""

from __future__ import annotations

import os

from qcomm.testing.multiprocess import free_ports
from tests.rendezvous.test_launch import Job, pytestmark  # noqa: F401
from tests.rendezvous.test_rejoin import (
    KILL_AT,
    LINKED,
    STEPS,
    _assert_rejoined,
    _end_once_back,
)

TOKEN = "the-job-token-0123456789abcdef"


def test_the_two_site_recipe_trains_loses_a_node_and_takes_it_back(tmp_path) -> None:
    ports = free_ports(2)
    envs = [{"QCOMM_TOKEN": TOKEN, "QCOMM_LISTEN": f"127.0.0.1:{ports[0]}"},
            {"QCOMM_TOKEN": TOKEN, "QCOMM_LISTEN": f"127.0.0.1:{ports[1]}"},
            {"QCOMM_TOKEN": TOKEN}]
    assert "QCOMM_LISTEN" not in os.environ
    job = Job(tmp_path, 3, env={"QCOMM_TOKEN": TOKEN})   # the rendezvous admits only them
    try:
        for node in range(3):
            job.start(node, LINKED, restarts=1, node_id=True, env=envs[node])
        job.wait_for(1, rf"^step {KILL_AT}/{STEPS}")
        job.kill_worker(1)   # its torchrun starts it again: it takes its seat back
        _end_once_back(job)
        codes = job.exit_codes([0, 1, 2])
    finally:
        job.stop()
    _assert_rejoined(job, codes)
    outs = [job.output(n) for n in range(3)]
    assert all(TOKEN not in out for out in outs)
    # the links are TCP ones, admitted by the token and encrypted; node 2 (no port) dials both
    assert f"link to rank 1: TCP, accepted on 127.0.0.1:{ports[0]}, token checked, encrypted" \
        in outs[0], outs[0][-3000:]
    assert outs[2].count("TCP, dialled 127.0.0.1:") >= 2, outs[2][-3000:]
    # the layout line says so too, and that the rendezvous was reached through the tunnel
    assert (f"links between nodes: one-port TCP, accepting on 127.0.0.1:{ports[0]} and "
            "dialling the peers that accept less; job token checked, encrypted (AES-256-GCM), "
            "the rendezvous through an encrypted tunnel") in outs[0], outs[0][-3000:]
    assert "accepted on" not in outs[2], outs[2][-3000:]
