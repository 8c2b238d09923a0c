"""A node that dies comes back to the running job, as processes on localhost: a rendezvous and
one torchrun per node (examples/train_charlm.py, a tiny model, ``--on-peer-loss continue``: the
nodes linked through the rendezvous, :func:`qcomm.rendezvous.init_node`). Restarted by its own
torchrun, or by hand with its ``--node-id``, it starts from a running neighbour's state and every
node ends with the three of them live and the same averaged model. A node that comes back with
other options is refused alone; one that dies again while it joins is a loss like any other; a
node of two ranks rejoins as one node.

The nodes run until the test has seen what it waits for (the node back, linked and training
with the others), then end on ``--stop-file`` (:meth:`Job.end`) and average as at their
``--steps``: a step count long enough to outlast a restart's tens of seconds on a loaded
machine was spent in full on every machine, and could still end the job before a restarted
node arrived on a slower one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.rendezvous.test_launch import (  # noqa: F401
    ENDED,
    STOP_FILE,
    UNREACHED,
    Job,
    _digest,
    _outputs,
    pytestmark,
)

STEPS = UNREACHED   # a bound the job never reaches: it ends on its --stop-file
KILL_AT = 200       # the step node 1 dies at; the others train on past it
# Each step sleeps 20 ms after its backward (a larger model's compute): the tiny model's steps,
# a few ms of CPU each, would otherwise spin on every core while the test waits for a restart,
# and slow that very restart.
PACE = ["--compute-ms", "20"]
LINKED = ["--steps", str(STEPS), "--log-every", "50", "--wait-free", "--on-peer-loss",
          "continue", "--timeout-s", "20", "--stop-file", STOP_FILE, *PACE]
BACK = r"\(node 1 joined: the parameters a running neighbour handed it\)$"


def _end_once_back(job: Job) -> None:
    """End the run once node 1 is back: it trained to a logged step past its join and both
    others linked to it."""
    job.wait_for(1, BACK + r"[\s\S]*^step \d+/")
    for n in (0, 2):
        job.wait_for(n, rf"rank {n} linked to member 1, which joins; 3 of 3 nodes live")
    job.end()


def _end_once_refused(job: Job) -> None:
    """End the run once node 1's torchrun exited (refused) and both others trained on past
    it to a logged step."""
    job.exit_codes([1])
    for n in (0, 2):
        job.wait_for_next(n, r"^step \d+/")
    job.end()


def _end_once_lost_again(job: Job) -> None:
    """Kill node 1 the moment it has announced its join; end the run once both others lost
    it again (their second drop of it) and trained on to a logged step."""
    job.wait_for(1, r"node 1 \(incarnation 2\) joins the running job")
    job.kill(1)
    for n in (0, 2):
        job.wait_for(n, rf"rank {n} dropped its gossip neighbour rank 1 at step", count=2)
        job.wait_for_next(n, r"^step \d+/")
    job.end()


def _assert_rejoined(job: Job, codes: list[int | None]) -> None:
    assert codes == [0, 0, 0], _outputs(job, [0, 1, 2])
    digests = [_digest(job.output(n)) for n in range(3)]
    assert [rank for rank, _ in digests] == [0, 1, 2]
    assert len({d for _, d in digests}) == 1, digests   # one model: the joiner's too
    back = job.output(1)
    assert "node 1 (incarnation 2) joins the running job" in back, back[-3000:]
    at = re.search(r"node 1 joined at step (\d+) from a running neighbour's state", back)
    assert at is not None and int(at.group(1)) > KILL_AT, back[-3000:]   # where the others were
    # its first validation loss is of the parameters it joined with, not of its fresh ones
    joined = back.split("node 1 joins the running job: its validation loss follows")
    assert len(joined) == 2, back[-3000:]
    losses = re.findall(r"^validation loss at step (\d+): \S+ \((.*)\)$", joined[1], re.M)
    assert losses[0][1] == "node 1 joined: the parameters a running neighbour handed it", \
        back[-3000:]
    assert int(losses[0][0]) >= int(at.group(1)), back[-3000:]
    for n in (0, 2):
        out = job.output(n)
        assert re.search(rf"rank {n} dropped its gossip neighbour rank 1 at step", out), \
            out[-3000:]
        assert re.search(rf"rank {n} linked to member 1, which joins; 3 of 3 nodes live", out), \
            out[-3000:]
        # the node that came back is reported so, not as dropped
        assert re.search(r"^nodes live at the end: 3 \(ranks lost and back: \[1\]\)$", out,
                         re.M), out[-3000:]
    for n in range(3):
        assert re.search(r"^nodes live at the end: 3\b", job.output(n), re.M), \
            job.output(n)[-3000:]
        assert re.search(ENDED, job.output(n), re.M), job.output(n)[-3000:]   # the job's end
    ended = re.search(ENDED, back, re.M)
    assert ended is not None and int(ended.group(1)) > int(at.group(1)), back[-3000:]


def _assert_two_nodes_of_two_end_in_one_model(job: Job, codes: list[int | None]) -> None:
    assert codes == [0, 0], _outputs(job, [0, 1])
    found = re.findall(r"rank (\d+): parameters sha256 ([0-9a-f]{64})",
                       job.output(0) + job.output(1))
    assert sorted(int(rank) for rank, _ in found) == [0, 1, 2, 3], found
    assert len({digest for _, digest in found}) == 1, found


def _machine_restarted(tmp: Path, args: list[str], then: Callable[[Job], None]
                       ) -> tuple[Job, list[int | None]]:
    """Node 1's machine dies at step KILL_AT, agent and all; once its neighbour dropped it, a new
    torchrun with --node-id 1 and ``args``; ``then(job)`` waits for what follows and ends the
    run. The job and the three exit codes."""
    job = Job(tmp, 3)
    try:
        for node in range(3):
            job.start(node, LINKED)
        job.wait_for(1, rf"^step {KILL_AT}/{STEPS}")
        job.kill(1)
        job.wait_for(0, r"dropped its gossip neighbour rank 1")
        job.start(1, args)
        then(job)
        return job, job.exit_codes([0, 1, 2])
    finally:
        job.stop()


def test_a_worker_restarted_by_its_torchrun_rejoins_the_running_job(tmp_path: Path) -> None:
    """As README.md launches it: torchrun --standalone --nproc-per-node 1 --max-restarts,
    no --node-id (seats in order of arrival; the restarted worker takes its run's back)."""
    job = Job(tmp_path, 3)
    try:
        for node in range(3):
            job.start(node, LINKED, restarts=1, node_id=False)
            job.wait_for(node, r"parameters; 3 processes")   # seated: the next arrives after
        job.wait_for(1, rf"^step {KILL_AT}/{STEPS}")
        job.kill_worker(1)   # its torchrun starts it again: it takes its seat back
        _end_once_back(job)
        codes = job.exit_codes([0, 1, 2])
    finally:
        job.stop()
    _assert_rejoined(job, codes)


def test_a_machine_restarted_by_hand_takes_its_seat_back_by_node_id(tmp_path: Path) -> None:
    job, codes = _machine_restarted(tmp_path, LINKED, _end_once_back)
    _assert_rejoined(job, codes)


def test_a_node_that_comes_back_with_other_options_is_refused_alone(tmp_path: Path) -> None:
    job, codes = _machine_restarted(tmp_path, [*LINKED, "--bits", "2"], _end_once_refused)
    assert codes[0] == codes[2] == 0 and codes[1] != 0, _outputs(job, [0, 1, 2])
    assert "this node's bits is 2 but the running job's is 4" in job.output(1), \
        job.output(1)[-3000:]
    survivors = [_digest(job.output(n)) for n in (0, 2)]
    assert survivors[0][1] == survivors[1][1], survivors
    for n in (0, 2):
        assert re.search(r"^nodes live at the end: 2\b", job.output(n), re.M), \
            job.output(n)[-3000:]


def test_a_joiner_that_dies_during_its_join_is_a_loss_like_any_other(tmp_path: Path) -> None:
    """Node 1 comes back by hand and its machine dies again the moment it has announced its
    join: the running nodes that admitted it (or admit it after) lose it as any node, and the
    two finish with one model."""
    job, codes = _machine_restarted(tmp_path, LINKED, _end_once_lost_again)
    assert codes[0] == codes[2] == 0, _outputs(job, [0, 1, 2])
    survivors = [_digest(job.output(n)) for n in (0, 2)]
    assert survivors[0][1] == survivors[1][1], survivors
    for n in (0, 2):
        out = job.output(n)
        assert re.search(r"^nodes live at the end: 2\b", out, re.M), out[-3000:]
        assert re.search(ENDED, out, re.M), out[-3000:]


def test_nodes_of_two_ranks_linked_end_in_one_model(tmp_path: Path) -> None:
    """Two nodes of two ranks each: each rail (local rank 0, local rank 1) its own group of
    links; the four ranks end with one averaged model."""
    job = Job(tmp_path, 2)
    try:
        for node in range(2):
            job.start(node, ["--steps", "300", "--log-every", "100", "--wait-free",
                             "--on-peer-loss", "continue", "--timeout-s", "20"], nproc=2)
        codes = job.exit_codes([0, 1])
    finally:
        job.stop()
    _assert_two_nodes_of_two_end_in_one_model(job, codes)
    assert "qcomm: 2 nodes x 2 ranks;" in job.output(0), job.output(0)[-3000:]


def test_a_fourth_node_started_later_joins_a_job_of_three(tmp_path: Path) -> None:
    """The rendezvous with --nodes 3 --max-nodes 4: three nodes start linked past seat 3; a
    fourth, started once they are seated, takes it, joins from node 2's state at the step the
    job is at, and the four end with one model. (Started at a fixed step of the others, its
    own start, tens of seconds on a loaded machine, could outlast their run.)"""
    job = Job(tmp_path, 3, max_nodes=4)
    try:
        for node in range(3):
            job.start(node, LINKED, node_id=False)
            job.wait_for(node, r"parameters; 4 processes")   # seated: the next arrives after
        job.start(3, LINKED, node_id=False)
        # the end once node 3 trained to a logged step past its join and every node has it
        job.wait_for(3, r"\(node 3 joined: the parameters a running neighbour handed it\)$"
                        r"[\s\S]*^step \d+/")
        for node in range(3):
            job.wait_for(node, r"member 3(, which)? joins; 4 of 4 nodes live")
        job.end()
        codes = job.exit_codes([0, 1, 2, 3])
    finally:
        job.stop()
    assert codes == [0, 0, 0, 0], _outputs(job, [0, 1, 2, 3])
    digests = [_digest(job.output(n)) for n in range(4)]
    assert [rank for rank, _ in digests] == [0, 1, 2, 3]
    assert len({d for _, d in digests}) == 1, digests
    late = job.output(3)
    at = re.search(r"node 3 joined at step (\d+) from a running neighbour's state", late)
    assert at is not None and int(at.group(1)) > 0, late[-3000:]   # the job's, not its own 0
    assert "offered its state to node 3" in job.output(2), job.output(2)[-3000:]
    for n in range(4):
        out = job.output(n)
        assert re.search(r"^nodes live at the end: 4\b", out, re.M), out[-3000:]
        assert "dropped its gossip neighbour" not in out, out[-3000:]   # absent is no loss



def test_a_node_of_two_ranks_restarted_by_its_torchrun_rejoins_as_one_node(tmp_path: Path) -> None:
    """Two nodes of two ranks: node 1's workers die at step KILL_AT and its torchrun starts both
    again. Each rank takes its own rail's neighbour's state; the node's two ranks agree on one
    step and one model, and the four ranks end with one model."""
    job = Job(tmp_path, 2)
    try:
        for node in range(2):
            job.start(node, LINKED, restarts=1, nproc=2)
        job.wait_for(1, rf"^step {KILL_AT}/{STEPS}")
        job.kill_worker(1)
        # the end once both ranks joined, from both rails, and trained to a logged step
        job.wait_for(1, r"node 1 joined at step \d+ from a running neighbour's state", count=2)
        job.wait_for(0, r"node 0 offered its state to node 1 \(incarnation 2\)", count=2)
        job.wait_for(1, BACK + r"[\s\S]*^step \d+/")
        job.end()
        codes = job.exit_codes([0, 1])
    finally:
        job.stop()
    _assert_two_nodes_of_two_end_in_one_model(job, codes)
    back = job.output(1)
    joined = re.findall(r"node 1 joined at step (\d+) from a running neighbour's state", back)
    assert len(joined) == 2 and len(set(joined)) == 1, back[-3000:]   # one step, both ranks
    assert int(joined[0]) > KILL_AT, back[-3000:]
    offered = re.findall(r"node 0 offered its state to node 1 \(incarnation 2\)", job.output(0))
    assert len(offered) == 2, job.output(0)[-3000:]   # one per rail
    for n in range(2):
        assert re.search(r"^nodes live at the end: 2\b", job.output(n), re.M), \
            job.output(n)[-3000:]
