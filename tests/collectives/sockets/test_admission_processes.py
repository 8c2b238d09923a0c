"""Stray processes try links on a running member's port while three members with the job token
gossip over TCP links (:mod:`qcomm.collectives.sockets`), each a process on localhost: one
with a wrong token, one with none, one that sends bytes with no handshake. Each is refused
(the first logged by the member, once), and none of its bytes reach the gossip: no member
loses a link or a peer, and the members end with one sum, the same bits on each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from qcomm.testing.join_world import wait_progress

from ..test_join_processes import REPO, _finish, _worker

TOKEN = "the-job-token-0123456789abcdef"


def _stray(port: int, mode: str, token: str | None, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "QCOMM_TOKEN"}
    if token is not None:
        env["QCOMM_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", "qcomm.testing.stray_link", "--port",
                             str(port), "--mode", mode, *args], cwd=REPO,
                            env={**env, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_strays_are_refused_while_the_job_goes_on(
        tmp_path: Path, rendezvous: tuple[int, dist.Store]) -> None:
    port, store = rendezvous
    outs = [tmp_path / f"m{i}.pt" for i in range(3)]
    procs = [_worker(i, port, 600, outs[i], transport="sockets",
                     env={"QCOMM_TOKEN": TOKEN}) for i in range(3)]
    try:
        wait_progress(store, "progress/0/1", 50, 60)
        strays = [_stray(port, "token", "a-wrong-token-0123456789"),
                  _stray(port, "token", None),
                  _stray(port, "garbage", None)]
        said = _finish(strays, 60)
        wait_progress(store, "progress/0/1", 200, 60)   # still going after them
    finally:
        logs = _finish(procs, 120)
    assert [p.returncode for p in strays] == [0, 0, 0], said
    assert "refused: AdmissionError: refused by the other node: wrong or missing job token" \
        in said[0]
    assert "(this node has no QCOMM_TOKEN)" in said[1]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(logs)
    # member 0 logged the first refusal from that address, once, and never the token
    assert logs[0].count("refused a connection from 127.0.0.1") == 1, logs[0]
    assert all(TOKEN not in log for log in logs + said)
    res = [torch.load(o, weights_only=True) for o in outs]
    for i, r in enumerate(res):
        assert r["live"] == 3 and r["lost"] == [] and r["losses"] == 0, (i, r)
    assert all(torch.equal(r["sum"], res[0]["sum"]) for r in res)
