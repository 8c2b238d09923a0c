"""``wait_free=True`` over Gloo, one process per rank: a stalled node holds nobody back, every
node ends with the same exact average and exits cleanly, and a silent neighbour is the named
error within the deadline."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from qcomm.sgd import ASSGD
from qcomm.testing.multiprocess import run_world
from tests.engine.problems import mlp, mlp_loss
from tests.worlds import survivors_meet

SLOW_STEPS = 2
FAST_STEPS = 24   # < max_backlog (64): node 0 holds every message sent to it while it stalls
TIMEOUT_S = 3.0
MARGIN_S = 2.0


def _wait_for_files(directory: Path, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((directory / n).exists() for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {names} in {directory} within {timeout_s} s")
        time.sleep(0.01)


def _stalled_node_body(rank: int, world: int, ppn: int, directory: str) -> dict:
    torch.set_num_threads(1)
    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, procs_per_node=ppn,
                wait_free=True, sync_every=2, fragments=2, timeout_s=30)
    # Node 0 takes SLOW_STEPS steps, then stalls until every other rank has taken FAST_STEPS:
    # the others can only finish if nothing of theirs waits for node 0 (a node that waited
    # for its neighbours' rounds would wait here until its timeout and raise). A stall, not a
    # slower pace: step counts within a time budget (a pause of 0.12 s against 0.01 s) fell
    # from 100+ to 1 in a loaded CI run, where one step of a fast node took the whole budget.
    slow = rank // ppn == 0
    fast_ranks = [f"done-{r}" for r in range(ppn, world)]

    def stop(step: int) -> bool:   # asked on the node's first rank; node_any tells the others
        if not slow:
            return step >= FAST_STEPS
        if step < SLOW_STEPS:
            return False
        _wait_for_files(Path(directory), fast_ranks, timeout_s=90)
        return True

    steps = 0
    while not opt.node_any(rank % ppn == 0 and stop(steps)):
        opt.zero_grad()
        mlp_loss(model, rank, steps).backward()
        opt.step()
        steps += 1
    if not slow:
        Path(directory, f"done-{rank}").write_text(str(steps))
    opt.average_parameters()
    params = [p.detach().clone() for p in model.parameters()]
    st = opt.stats()
    opt.close()
    return {"steps": steps, "params": params, "received": st["rounds_received"]}


@pytest.mark.parametrize(("nodes", "ppn"), [(2, 1), (4, 1), (2, 2)])
def test_a_stalled_node_holds_nobody_back(nodes: int, ppn: int, tmp_path) -> None:
    res = run_world(_stalled_node_body, nodes * ppn, args=(ppn, str(tmp_path)), timeout_s=120)
    steps = [r["steps"] for r in res]
    assert steps == [SLOW_STEPS] * ppn + [FAST_STEPS] * (nodes - 1) * ppn
    for r in res:
        for a, b in zip(r["params"], res[0]["params"], strict=True):
            assert torch.equal(a, b)
    # After the drain each rank holds every round of its rail neighbours (a round every step).
    for rank, r in enumerate(res):
        for peer, got in r["received"].items():
            assert got == steps[peer], (rank, r["received"], steps)


def _silent_body(rank: int, world: int, directory: str) -> dict:
    from qcomm.collectives.errors import PeerError

    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.05, procs_per_node=1, wait_free=True,
                timeout_s=TIMEOUT_S)
    for step in range(400):
        if rank == world - 1 and step == 5:
            Path(directory, "stop_time").write_text(json.dumps(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)   # alive, sockets open, silent
        time.sleep(0.02)
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        try:
            opt.step()
        except PeerError as e:
            at = time.time()
            t0 = time.monotonic()
            opt.close()
            out = {"type": type(e).__name__, "peers": e.peers, "link": e.link, "at": at,
                   "close_s": time.monotonic() - t0}
            break
    else:
        out = {"type": None}
    survivors_meet("silent", world - 1)
    return out


def test_a_silent_neighbour_is_the_named_timeout_within_the_deadline(tmp_path) -> None:
    world = 3
    victim = world - 1
    res = run_world(_silent_body, world, args=(str(tmp_path),), timeout_s=120,
                    allow_exit={victim})
    stopped = json.loads((tmp_path / "stop_time").read_text())
    for rank, r in enumerate(res[:victim]):
        where = f"rank {rank}: {r}"
        assert r["type"] == "PeerTimeoutError" and r["peers"] == [victim], where
        assert r["link"] == "inter", where
        assert r["at"] - stopped <= TIMEOUT_S + MARGIN_S, where
        assert r["close_s"] < 12.0, where


def _clean_body(rank: int, world: int) -> None:
    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.05, procs_per_node=1, wait_free=True)
    for step in range(5 + 3 * rank):   # the ranks take different numbers of steps
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
    opt.average_parameters()
    opt.close()  # then the launcher calls destroy_process_group() and the process exits


def test_clean_wait_free_runs_never_abort_at_exit() -> None:
    """The streams' threads are gone (goodbyes exchanged) before the group is destroyed: every
    process of 10 three-rank runs exits through the normal interpreter shutdown."""
    from qcomm.testing.exits import fresh_world_exits

    statuses = fresh_world_exits(_clean_body, 3, runs=10, timeout_s=150)
    bad = [(run, rank, s) for run, ranks in enumerate(statuses)
           for rank, s in enumerate(ranks) if s != "exit 0"]
    assert len(statuses) == 10 and not bad, bad
