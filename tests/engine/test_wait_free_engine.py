"""The engine with ``wait_free=True`` on an in-memory world (ranks as threads): a stalled node holds
nobody back, nodes take different numbers of steps, and the collective points (exact average,
checkpoint, close) still agree."""

from __future__ import annotations

import threading

import pytest
import torch

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.engine import CommOptions
from qcomm.sgd import HierarchicalOptimizer
from tests.engine.problems import mlp, mlp_loss

SLOW_STEPS = 2
FAST_STEPS = 24   # < max_backlog (64): node 0 holds what is sent to it while it stalls


def _opt(model: torch.nn.Module, rank: int, world: MemoryWorld, ppn: int,
         **comm) -> HierarchicalOptimizer:
    layout = Topology(ppn, rank=rank, world_size=world.world_size, world=world)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return HierarchicalOptimizer(inner, layout=layout, procs_per_node=ppn, seed=3,
                                 wait_free=True, timeout_s=20, **comm)


def _train_until(model, opt, rank: int, ppn: int, stop) -> int:
    """Steps until ``stop(step)`` on the node's first rank (every rank of a node stops
    together: node_any)."""
    step = 0
    while not opt.node_any(rank % ppn == 0 and stop(step)):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
        step += 1
    return step


@pytest.mark.parametrize(("nodes", "ppn"), [(2, 1), (4, 1), (2, 2)])
def test_a_stalled_node_holds_nobody_back_and_the_average_is_exact(nodes: int,
                                                                    ppn: int) -> None:
    """Node 0 takes SLOW_STEPS steps, then stalls until every other rank has taken FAST_STEPS:
    they finish only if nothing of theirs waits for node 0's rounds (bounded staleness would
    wait for them until its timeout). A stall, not a slower pace, so that no step count
    depends on how busy the machine is."""
    world = MemoryWorld(nodes * ppn, timeout_s=30)
    fast_done = threading.Semaphore(0)

    def stalled_until_the_others_are_done(step: int) -> bool:
        if step < SLOW_STEPS:
            return False
        for _ in range((nodes - 1) * ppn):
            assert fast_done.acquire(timeout=60), "the fast ranks did not finish"
        return True

    def body(rank: int) -> dict:
        model = mlp(0)
        opt = _opt(model, rank, world, ppn, sync_every=2, fragments=2)
        slow = rank // ppn == 0
        stop = stalled_until_the_others_are_done if slow else (lambda s: s >= FAST_STEPS)
        steps = _train_until(model, opt, rank, ppn, stop)
        if not slow:
            fast_done.release()
        st = opt.stats()
        opt.average_parameters()
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return {"steps": steps, "stats": st, "params": params}

    res = world.run(body, timeout_s=60)
    assert [r["steps"] for r in res] == [SLOW_STEPS] * ppn + [FAST_STEPS] * (nodes - 1) * ppn
    for r in res:
        assert r["stats"]["steps"] == r["steps"]
        assert r["stats"]["gossip_rounds"] == r["steps"]  # a round every step (H=2, F=2)
        assert set(r["stats"]["rounds_received"]) == set(r["stats"]["lag_rounds"])
        # every round but the first mixed a fragment, at some lag (gossip rounds - 1 of them)
        lags = r["stats"]["mix_lag_rounds"]
        assert sum(lags.values()) == r["steps"] - 1 and min(lags) >= 1
        assert r["stats"]["terms_paired"]["possible"] > 0
        for a, b in zip(r["params"], res[0]["params"], strict=True):
            assert torch.equal(a, b)
    # The node's ranks took the same steps.
    for node in range(nodes):
        assert len({res[node * ppn + i]["steps"] for i in range(ppn)}) == 1


def test_checkpoint_drains_and_resumes_with_every_message_accounted_for() -> None:
    world = MemoryWorld(3, timeout_s=30)
    restarted = MemoryWorld(3, timeout_s=30)  # the second job's groups and streams

    def body(rank: int) -> dict:
        model = mlp(0)
        opt = _opt(model, rank, world, 1, graph="complete")
        # the ranks take different numbers of steps: the checkpoint's cut holds each count
        _train_until(model, opt, rank, 1, lambda step: step >= (4 if rank == 0 else 12 + rank))
        state = opt.state_dict()            # collective: drains the gossip first
        snapshot = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in state["qcomm"]["gossip"].items()}
        opt.close()
        # A restarted job: new optimizer and groups, the saved state.
        model2 = mlp(0)
        opt2 = _opt(model2, rank, restarted, 1, graph="complete")
        opt2.load_state_dict(state)
        for step in range(5):
            opt2.zero_grad()
            mlp_loss(model2, rank, step).backward()
            opt2.step()
        opt2.average_parameters()   # drains: every round of the new job arrived
        out = [p.detach().clone() for p in model2.parameters()]
        st = opt2.stats()
        opt2.close()
        return {"gossip": snapshot, "params": out, "resumed": st}

    res = world.run(body, timeout_s=60)
    rounds = [r["gossip"]["rounds_started"] for r in res]
    for rank, r in enumerate(res):
        peers = [p for p in range(3) if p != rank]
        assert r["gossip"]["received"] == [rounds[p] for p in peers]
        # The resumed streams carry on from the saved counts: 5 more rounds of each peer.
        assert list(r["resumed"]["rounds_received"].values()) == [rounds[p] + 5 for p in peers]
        for a, b in zip(r["params"], res[0]["params"], strict=True):
            assert torch.equal(a, b)


def test_nonfinite_skip_is_decided_by_each_node_alone() -> None:
    world = MemoryWorld(2, timeout_s=30)

    def body(rank: int) -> dict:
        model = mlp(0)
        opt = _opt(model, rank, world, 1, on_nonfinite="skip")
        for step in range(6):
            opt.zero_grad()
            loss = mlp_loss(model, rank, step)
            if rank == 1 and step == 2:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
        st = opt.stats()
        opt.average_parameters()
        opt.close()
        return st

    res = world.run(body, timeout_s=60)
    assert res[0]["skipped_steps"] == 0 and res[0]["steps"] == 6
    assert res[1]["skipped_steps"] == 1 and res[1]["steps"] == 5


@pytest.mark.parametrize(("name", "value", "error"), [
    ("wait_free", 1, TypeError), ("wait_free", "yes", TypeError),
    ("max_backlog", 0, ValueError), ("max_backlog", 2.5, TypeError),
    ("on_peer_loss", "ignore", ValueError), ("on_peer_loss", None, ValueError),
])
def test_bad_wait_free_options_name_the_argument(name: str, value: object,
                                                 error: type[Exception]) -> None:
    with pytest.raises(error, match=name):
        CommOptions(**{name: value})


def test_continuing_after_a_loss_needs_wait_free() -> None:
    with pytest.raises(ValueError, match="on_peer_loss='continue' needs wait_free=True"):
        CommOptions(on_peer_loss="continue")
    assert CommOptions(wait_free=True, on_peer_loss="continue").on_peer_loss == "continue"
