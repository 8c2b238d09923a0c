"""A node the running job refuses (other options: ``--bits 2`` in a job of ``--bits 4``), as
processes on localhost: a rendezvous and one torchrun per node (examples/train_charlm.py, a tiny
model, linked). The refused node's torchrun restarts (``--max-restarts 3``) are refused at once,
before they take a seat, with the same named error and exit status 78; the running node, which
said every few seconds what it waited for, stops waiting for the refused one and drops it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from qcomm.rendezvous.refusals import REFUSED_EXIT_CODE
from tests.rendezvous.test_launch import Job, _outputs, pytestmark  # noqa: F401

LINKED = ["--steps", "100000", "--log-every", "500", "--wait-free", "--on-peer-loss",
          "continue", "--timeout-s", "120"]
REFUSAL = "this node's bits is 2 but the running job's is 4"


def test_a_refused_node_is_not_retried_in_vain_and_not_waited_for(tmp_path: Path) -> None:
    job = Job(tmp_path, 2)
    try:
        job.start(0, LINKED)
        # node 1 has not started: node 0 says so, with the rendezvous and its time left
        job.wait_for(0, rf"rank 0 \(rail0\) waits for member 1 \(rank 1\) to start at the "
                        rf"rendezvous {re.escape(job.address)}; \d+ s left of 600")
        started = time.monotonic()
        job.start(1, [*LINKED, "--bits", "2"], restarts=3)
        [code] = job.exit_codes([1])
        refused_s = time.monotonic() - started
        job.wait_for(0, r"dropped its gossip neighbour rank 1")
        dropped_s = time.monotonic() - started
    finally:
        job.stop()
    bad, good = job.output(1), job.output(0)
    assert code is not None and code != 0, _outputs(job, [0, 1])
    # the first attempt is refused at its first step; its 3 restarts before taking a seat
    assert len(re.findall(rf"refused by the running job: {REFUSAL}", bad)) == 4, bad[-4000:]
    assert len(re.findall(r"this torchrun run was refused by the job before", bad)) == 3, \
        bad[-4000:]
    assert len(re.findall(r"node 1 \(incarnation", bad)) == 0, bad[-4000:]   # nothing joined
    assert re.search(rf"exitcode\s*:\s*{REFUSED_EXIT_CODE}\b", bad), bad[-4000:]
    # node 0 dropped it for its refusal, not at the end of its 120 s wait
    assert re.search(rf"dropped its gossip neighbour rank 1 at step \d+ .*was refused by the "
                     rf"job: {REFUSAL}", good), good[-4000:]
    assert dropped_s < 100 and refused_s < 100, (dropped_s, refused_s)
