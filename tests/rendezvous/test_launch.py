"""One torchrun per node, found through ``python -m qcomm.rendezvous``, as processes on localhost
(examples/train_charlm.py, a tiny model): three nodes end in one model; node 0 (whose process
held the job's store under the one-torchrun launch) killed mid-run leaves the other two to
finish, agree and exit 0; the rendezvous killed mid-run stops no node.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qcomm.testing.multiprocess import descendants, free_port, kill_sessions
from tests.examples.test_train_charlm import EXAMPLE, REPO, TINY, TORCHRUN

LAUNCH_TIMEOUT_S = 150  # a hang fails the test instead of stalling the suite
STOP_FILE = "stop"  # a --stop-file, relative to the nodes' working directory (Job.end)
UNREACHED = 100000  # a --steps the job never reaches: it ends on its --stop-file
# the line of a node that ran to the job's end on its stop file (not a failure's)
ENDED = rf"^stopped at step (\d+) of {UNREACHED}: {STOP_FILE} exists$"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun next to "
                                f"{sys.executable}")


class Job:
    """A rendezvous and one torchrun agent per node, each node's output in its own file."""

    def __init__(self, tmp: Path, nodes: int, max_nodes: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.tmp, self.port = tmp, free_port()
        self.address = f"127.0.0.1:{self.port}"
        grow = [] if max_nodes is None else ["--max-nodes", str(max_nodes)]
        self.rendezvous = subprocess.Popen(
            [sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1", "--port",
             str(self.port), "--nodes", str(nodes), *grow], env=dict(ENV, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        line = self.rendezvous.stdout.readline()  # it listens once it says so
        assert "listening on 127.0.0.1" in line, line
        self.agents: dict[int, subprocess.Popen] = {}

    def start(self, node: int, args: list[str], *, restarts: int = 0,
              node_id: bool = True, nproc: int = 1, env: dict[str, str] | None = None) -> None:
        """Start node ``node``'s torchrun (a new log; ``restarts``: its --max-restarts;
        without ``node_id`` it takes the seat the rendezvous gives it; ``nproc`` ranks;
        ``env``: variables of its own)."""
        seat = ["--node-id", str(node)] if node_id else []
        with open(self.log(node), "w") as f:
            self.agents[node] = subprocess.Popen(
                [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
                 str(restarts), str(EXAMPLE), *TINY, *seat, *args],
                cwd=self.tmp, env=dict(ENV, QCOMM_RENDEZVOUS=self.address, **(env or {})),
                stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, node: int) -> Path:
        return self.tmp / f"node{node}.log"

    def output(self, node: int) -> str:
        return self.log(node).read_text()

    def wait_for(self, node: int, pattern: str, count: int = 1) -> None:
        """Until node ``node``'s output holds ``count`` matches of ``pattern`` (re.M)."""
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(re.findall(pattern, self.output(node), re.M)) < count:
            assert time.monotonic() < deadline, self.output(node)[-3000:]
            assert self.agents[node].poll() is None, self.output(node)[-3000:]
            time.sleep(0.1)

    def wait_for_next(self, node: int, pattern: str) -> None:
        """Until node ``node`` writes a new line of ``pattern``, after those it wrote so far."""
        self.wait_for(node, pattern, len(re.findall(pattern, self.output(node), re.M)) + 1)

    def end(self) -> None:
        """Create the nodes' ``--stop-file`` (STOP_FILE, in the job's directory, their working
        directory): each ends its run at its next logged step, as at its --steps."""
        (self.tmp / STOP_FILE).touch()

    def kill(self, node: int) -> None:
        """The machine dies: the agent and its worker, SIGKILL, nothing said."""
        agent = self.agents[node]
        for pid in [*descendants(agent.pid), agent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=10)

    def kill_worker(self, node: int) -> None:
        """The node's training process dies (SIGKILL); its torchrun agent lives on."""
        for pid in descendants(self.agents[node].pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def exit_codes(self, nodes: list[int]) -> list[int | None]:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while any(self.agents[n].poll() is None for n in nodes) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        return [self.agents[n].poll() for n in nodes]

    def stop(self) -> None:
        kill_sessions([*self.agents.values(), self.rendezvous])


def _digest(output: str) -> tuple[int, str]:
    found = re.findall(r"rank (\d+): parameters sha256 ([0-9a-f]{64})(?![0-9a-f])", output)
    assert len(found) == 1, output[-3000:]
    return int(found[0][0]), found[0][1]


def _outputs(job: Job, nodes: list[int]) -> str:
    return "\n".join(f"--- node {n}\n{job.output(n)[-3000:]}" for n in nodes)


def test_three_nodes_with_a_torchrun_each_end_in_one_model(tmp_path: Path) -> None:
    job = Job(tmp_path, 3)
    try:
        for node in (2, 0, 1):  # seats by --node-id, whatever the order of arrival
            job.start(node, [])
        codes = job.exit_codes([0, 1, 2])
    finally:
        job.stop()
    assert codes == [0, 0, 0], _outputs(job, [0, 1, 2])
    assert "qcomm: 3 nodes x 1 rank;" in job.output(0), job.output(0)[-3000:]
    digests = [_digest(job.output(n)) for n in range(3)]
    assert [rank for rank, _ in digests] == [0, 1, 2]  # node n holds rank n
    assert len({d for _, d in digests}) == 1, digests


def test_node_zero_killed_the_others_finish_agree_and_exit_0(tmp_path: Path) -> None:
    """Node 0 holds rank 0 (under one torchrun for the whole job, the job's store too). Killed a
    few hundred steps in, the other two drop it, train on, average over the two of them and
    exit 0 (no wait at exit for the node that died). They end on their ``--stop-file`` once
    both dropped it and trained to a logged step past the drop: a fixed step count long enough
    for a loaded machine was spent in full on every machine."""
    job = Job(tmp_path, 3)
    args = ["--steps", str(UNREACHED), "--log-every", "100", "--wait-free", "--on-peer-loss",
            "continue", "--timeout-s", "20", "--stop-file", STOP_FILE]
    try:
        for node in range(3):
            job.start(node, args)
        job.wait_for(0, rf"^step 200/{UNREACHED}")
        job.kill(0)
        for n in (1, 2):
            job.wait_for(n, rf"rank {n} dropped its gossip neighbour rank 0 at step \d+")
            job.wait_for_next(n, r"^step \d+/")
        job.end()
        codes = job.exit_codes([1, 2])
    finally:
        job.stop()
    assert codes == [0, 0], _outputs(job, [0, 1, 2])
    survivors = [_digest(job.output(n)) for n in (1, 2)]
    assert [rank for rank, _ in survivors] == [1, 2]
    assert survivors[0][1] == survivors[1][1], survivors
    for n in (1, 2):
        out = job.output(n)
        assert "nodes live at the end: 2 (ranks dropped: [0])" in out, out[-3000:]
        dropped = re.search(rf"rank {n} dropped its gossip neighbour rank 0 at step (\d+)", out)
        ended = re.search(ENDED, out, re.M)
        assert dropped is not None and ended is not None, out[-3000:]
        assert int(ended.group(1)) > int(dropped.group(1)), out[-3000:]


def test_the_rendezvous_killed_mid_run_stops_no_node_in_one_group(tmp_path: Path) -> None:
    """The nodes need the rendezvous only while they start: once they train, it may die
    (lockstep nodes, one process group across the nodes: they run to their --steps, 200
    steps past the kill, a stop file seen at different steps would stall them)."""
    job = Job(tmp_path, 2)
    try:
        for node in range(2):
            job.start(node, ["--steps", "300", "--log-every", "100"])
        codes = _kill_the_rendezvous_at_step_100(job, lambda: None)
    finally:
        job.stop()
    assert codes == [0, 0], _outputs(job, [0, 1])
    assert _digest(job.output(0))[1] == _digest(job.output(1))[1]
    for n in (0, 1):
        assert re.search(r"^step 300/300", job.output(n), re.M), job.output(n)[-3000:]


def test_the_rendezvous_killed_mid_run_stops_no_node_linked(tmp_path: Path) -> None:
    """Linked nodes (wait-free, gossip links opened through the rendezvous, which watches for
    joins while they train) need it only while their links open: it dies, they train on to
    two more logged steps each, then end on their stop file."""
    job = Job(tmp_path, 2)
    try:
        for node in range(2):
            job.start(node, ["--steps", str(UNREACHED), "--log-every", "100", "--wait-free",
                             "--on-peer-loss", "continue", "--stop-file", STOP_FILE])

        def two_more_logged_steps() -> None:
            for _ in range(2):
                for n in (0, 1):
                    job.wait_for_next(n, r"^step \d+/")
            job.end()

        codes = _kill_the_rendezvous_at_step_100(job, two_more_logged_steps)
    finally:
        job.stop()
    assert codes == [0, 0], _outputs(job, [0, 1])
    assert _digest(job.output(0))[1] == _digest(job.output(1))[1]
    for n in (0, 1):
        out = job.output(n)
        assert "nodes live at the end: 2" in out and "dropped" not in out, out[-3000:]
        ended = re.search(ENDED, out, re.M)
        assert ended is not None and int(ended.group(1)) >= 300, out[-3000:]


def _kill_the_rendezvous_at_step_100(job: Job, then: Callable[[], None]) -> list[int | None]:
    """SIGKILL the rendezvous once both nodes logged step 100, ``then()``; both exit codes."""
    for node in range(2):
        job.wait_for(node, r"^step 100/")
    os.killpg(job.rendezvous.pid, signal.SIGKILL)
    job.rendezvous.wait(timeout=10)
    then()
    return job.exit_codes([0, 1])
