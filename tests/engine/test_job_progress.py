"""``job_progress()``: the job's progress in local steps as a node knows it, what a slow node
drives its learning-rate schedule by. Alone or in lockstep it is the node's own steps; wait-free,
a node that took fewer steps than its neighbour learns the neighbour's count from its rounds."""

from __future__ import annotations

import threading

import torch

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.sgd import ASSGD
from tests.engine.problems import mlp, mlp_loss

KW = dict(lr=0.05, momentum=0.9, bits=4, seed=5, procs_per_node=1, timeout_s=60)


def _steps(opt: ASSGD, model: torch.nn.Module, rank: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()


def test_alone_it_is_the_steps_taken() -> None:
    model = mlp(0)
    opt = ASSGD(model.parameters(), **{**KW, "procs_per_node": None})
    assert opt.job_progress() == 0
    _steps(opt, model, 0, 0, 7)
    assert opt.job_progress() == 7


def _two_nodes(wait_free: bool, fast_steps: int, slow_steps: int) -> list[dict]:
    world = MemoryWorld(2, timeout_s=60)
    fast_done, slow_done = threading.Event(), threading.Event()

    def body(rank: int) -> dict:
        torch.set_num_threads(1)
        model = mlp(rank)
        opt = ASSGD(model.parameters(), layout=Topology(1, rank=rank, world_size=2, world=world),
                    wait_free=wait_free, **KW)
        if rank == 0:        # the fast node: all its steps, then waits for the slow one
            _steps(opt, model, rank, 0, fast_steps)
            fast_done.set()
            assert slow_done.wait(120)
        else:                # the slow node: fewer steps, one more once the fast one is done
            _steps(opt, model, rank, 0, slow_steps)
            assert fast_done.wait(120)
            _steps(opt, model, rank, slow_steps, 1)
            slow_done.set()
        out = {"own": opt.engine.steps, "job": opt.job_progress()}
        opt.close()
        return out

    threads = torch.get_num_threads()
    try:
        return world.run(body, timeout_s=240)
    finally:
        torch.set_num_threads(threads)


def test_wait_free_a_slow_node_learns_the_job_s_progress_from_its_neighbour() -> None:
    fast, slow = _two_nodes(wait_free=True, fast_steps=48, slow_steps=12)
    assert fast["own"] == 48 and fast["job"] == 48
    assert slow["own"] == 13
    # the fast node's rounds carry its count (to a round's period): far beyond its own 13
    assert 40 <= slow["job"] <= 48, slow


def test_in_lockstep_it_is_the_node_s_own_steps() -> None:
    world = MemoryWorld(2, timeout_s=60)

    def body(rank: int) -> int:
        torch.set_num_threads(1)
        model = mlp(rank)
        opt = ASSGD(model.parameters(), layout=Topology(1, rank=rank, world_size=2, world=world),
                    staleness=1, **KW)
        _steps(opt, model, rank, 0, 10)
        progress = opt.job_progress()
        opt.close()
        return progress

    threads = torch.get_num_threads()
    try:
        assert world.run(body, timeout_s=240) == [10, 10]
    finally:
        torch.set_num_threads(threads)
