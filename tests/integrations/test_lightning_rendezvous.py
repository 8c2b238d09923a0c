"""QcommStrategy under the rendezvous launch, as processes on localhost: ``python -m
qcomm.rendezvous`` and one ``torchrun --standalone`` per node (2 nodes of 2, Gloo), each node a
Lightning world of its own (tests/integrations/lightning_linked_node.py). After fit every rank of
the job holds one model, bytes crossed between the nodes, and the job's four ranks trained on
four different shards of the data."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra: pip install 'qcomm[lightning]'")

from qcomm.testing.multiprocess import free_port, kill_sessions
from tests.integrations.lightning_bodies import SAMPLES

REPO = Path(__file__).resolve().parents[2]
NODE = Path(__file__).with_name("lightning_linked_node.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
NODES, PROCS = 2, 2
TIMEOUT_S = 240   # the whole job: a hang fails the test instead of stalling the suite

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(),
                                reason=f"no torchrun next to {sys.executable}")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The job run once: every rank's record, by job rank."""
    tmp = tmp_path_factory.mktemp("linked")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    rendezvous = subprocess.Popen(
        [sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1", "--port", str(port),
         "--nodes", str(NODES)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    procs, logs = [rendezvous], [tmp / f"node{n}.log" for n in range(NODES)]
    try:
        line = rendezvous.stdout.readline()   # it listens once it says so
        assert "listening on 127.0.0.1" in line, line
        for n in range(NODES):
            with open(logs[n], "w") as log:
                procs.append(subprocess.Popen(
                    [str(TORCHRUN), "--standalone", "--nproc-per-node", str(PROCS),
                     str(NODE), str(tmp)], cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                    env=dict(env, QCOMM_RENDEZVOUS=f"127.0.0.1:{port}"),
                    start_new_session=True))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.poll() for p in procs[1:]]
        tails = "\n".join(f"--- node {n}\n{log.read_text()[-3000:]}" for n, log in enumerate(logs))
        assert codes == [0] * NODES, f"exit codes {codes} (None: still running after " \
                                     f"{TIMEOUT_S} s)\n{tails}"
    finally:
        kill_sessions(procs)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(NODES * PROCS)]


def test_each_node_is_a_lightning_world_of_its_own(job: list[dict]) -> None:
    for rank, rec in enumerate(job):
        node, local = divmod(rank, PROCS)
        assert rec["seat"] == (node, rank, NODES * PROCS)
        assert rec["lightning"] == (PROCS, local)   # Lightning's world size and global rank


def test_every_rank_of_the_job_holds_one_model_after_fit_and_at_validation(job: list[dict]
                                                                          ) -> None:
    first = job[0]
    assert len(first["val_params"]) == 2   # one validation per epoch
    for rec in job[1:]:
        assert torch.equal(rec["params"], first["params"])
        for mine, theirs in zip(rec["val_params"], first["val_params"], strict=True):
            assert torch.equal(mine, theirs)


def test_bytes_cross_between_the_nodes(job: list[dict]) -> None:
    for rec in job:
        assert rec["stats"]["bytes_sent"]["inter"] > 0
        assert rec["stats"]["live_nodes"] == NODES


def test_the_job_s_ranks_train_on_different_shards(job: list[dict]) -> None:
    # Lightning's sampler over the node alone would give both nodes the same shards: each
    # epoch the job's four ranks see every sample once.
    per_epoch = SAMPLES // (NODES * PROCS)
    seen = torch.cat([rec["samples"][:per_epoch] for rec in job])
    assert seen.numel() == SAMPLES and seen.unique().numel() == SAMPLES
