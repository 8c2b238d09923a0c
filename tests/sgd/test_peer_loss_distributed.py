"""``on_peer_loss="continue"`` over Gloo, one process per rank: a node killed with SIGKILL
mid-run (4x1 and 2x2) is dropped, the survivors finish, agree exactly after
``average_parameters()`` and keep learning; with ``"raise"`` the same kill is today's named
error on the neighbours."""

from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.sgd import ASSGD
from qcomm.testing.multiprocess import run_world
from tests.engine.problems import mlp, mlp_loss
from tests.worlds import survivors_meet

STEPS, KILL_AT, VICTIM = 90, 30, 1   # node 1 dies at step 30 of 90


TEACHER = torch.randn(6, 2, generator=torch.Generator().manual_seed(7))


def _teacher_loss(model: torch.nn.Module, batch: int) -> torch.Tensor:
    """A learnable problem (targets from a fixed linear teacher): the loss keeps falling for
    far longer than the run, so "it kept learning after the loss" is a real test."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(batch))
    return torch.nn.functional.mse_loss(model(x), x @ TEACHER)


def _fixed_batch_loss(model: torch.nn.Module, world: int) -> float:
    """The loss on 32 batches of every rank's data: one number all nodes are judged by."""
    with torch.no_grad():
        return statistics.fmean(float(_teacher_loss(model, b)) for b in range(32))


def _victims_neighbours(world: int, ppn: int) -> list[int]:
    """The ranks whose rail neighbour on the ring of nodes is the victim's rank on that rail."""
    nodes = world // ppn
    return [r for r in range(world)
            if r // ppn != VICTIM and (nodes == 2 or abs(r // ppn - VICTIM) in (1, nodes - 1))]


def _found_by_all_neighbours(opt: ASSGD, rank: int, world: int, ppn: int) -> bool:
    """Whether every rail neighbour of the victim has dropped it (each says so in the job's
    store once it has)."""
    store = dist.distributed_c10d._get_default_store()
    if VICTIM * ppn + rank % ppn in opt.stats()["dropped_ranks"]:
        store.set(f"dropped_by/{rank}", "1")
    return store.check([f"dropped_by/{r}" for r in _victims_neighbours(world, ppn)])


def _kill_body(rank: int, world: int, ppn: int, mode: str, how: str = "kill") -> dict:
    from qcomm.collectives.errors import PeerError

    torch.set_num_threads(1)
    model = mlp(0)
    # A hung node is found by its silence: a shorter bound than a dead one's, which the
    # kernel reports at once (a broken connection).
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, procs_per_node=ppn,
                wait_free=True, on_peer_loss=mode, timeout_s=20 if how == "kill" else 4)
    losses = []
    step = 0
    deadline = time.monotonic() + 90
    # A hung node: every survivor steps on until the victim's neighbours have dropped it. A
    # survivor that waited in average_parameters() for them instead would send nothing for
    # about timeout_s, and its own neighbours would count it silent too.
    # (the ranks of a node stop at the same step: node_any)
    while not opt.node_any(step >= STEPS and (how == "kill" or mode == "raise"
                                              or _found_by_all_neighbours(opt, rank, world,
                                                                          ppn))):
        assert time.monotonic() < deadline, f"rank {rank}: the hung node was not dropped"
        if rank // ppn == VICTIM and step == KILL_AT:
            # the machine is gone (no goodbye), or hung: alive, silent, its sockets open
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        opt.zero_grad()
        _teacher_loss(model, 1000 * rank + step).backward()
        try:
            opt.step()
        except PeerError as e:
            opt.close()
            return {"error": type(e).__name__, "peers": e.peers, "step": step}
        if step == KILL_AT - 1:
            losses.append(_fixed_batch_loss(model, world))
        step += 1
    try:
        opt.average_parameters()
    except PeerError as e:
        opt.close()
        return {"error": type(e).__name__, "peers": e.peers, "step": step}
    losses.append(_fixed_batch_loss(model, world))
    st = opt.stats()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return {"error": None, "params": params, "losses": losses, "live": st["live_nodes"],
            "dropped": st["dropped_ranks"]}


@pytest.mark.parametrize(("nodes", "ppn", "how"),
                         [(4, 1, "kill"), (2, 2, "kill"), (4, 1, "stop"), (2, 2, "stop")])
def test_a_killed_node_is_dropped_and_the_survivors_finish_in_agreement(
        nodes: int, ppn: int, how: str) -> None:
    """Killed or hung: only that node is dropped (a hung node's silence once cut every link
    of the members that noticed it, when the streams shared one Gloo group: each survivor
    then dropped every other node and trained alone)."""
    world = nodes * ppn
    victims = {VICTIM * ppn + i for i in range(ppn)}
    res = run_world(_kill_body, world, args=(ppn, "continue", how), timeout_s=180,
                    allow_exit=victims)
    survivors = [r for rank, r in enumerate(res) if rank not in victims]
    for r in survivors:
        assert r is not None and r["error"] is None, r
        assert r["live"] == nodes - 1
        # the exact average over the survivors: the same bits everywhere
        for a, b in zip(r["params"], survivors[0]["params"], strict=True):
            assert torch.equal(a, b)
        # and they went on learning after the loss
        assert r["losses"][1] < r["losses"][0], r["losses"]
    # the victim's rail neighbours saw it go
    dropped = {rank: r["dropped"] for rank, r in enumerate(res) if rank not in victims}
    for rank in _victims_neighbours(world, ppn):
        assert dropped[rank] == [VICTIM * ppn + rank % ppn], dropped


def test_with_raise_a_killed_node_is_the_named_error() -> None:
    """Its ring neighbours raise PeerLostError naming it, in whichever call they make next: a
    step, or the final average when a neighbour had taken all its steps before the victim
    reached its step KILL_AT (wait-free nodes do not wait for each other: on a loaded machine
    a neighbour can finish first). Every survivor stops with a named error."""
    res = run_world(_kill_body, 4, args=(1, "raise"), timeout_s=180, allow_exit={VICTIM})
    for rank in (0, 2):
        assert res[rank]["error"] == "PeerLostError" and res[rank]["peers"] == [VICTIM], res
    assert res[3]["error"] in ("PeerLostError", "PeerTimeoutError"), res  # in the average


def _save_body(rank: int, world: int, directory: str) -> dict | None:
    from qcomm.sgd import save_checkpoint

    torch.set_num_threads(1)
    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, wait_free=True,
                on_peer_loss="continue", timeout_s=20)
    for step in range(STEPS):
        if rank == VICTIM and step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        mlp_loss(model, (rank + step) % world, step % 8).backward()
        opt.step()
    opt.average_parameters()
    save_checkpoint(directory, opt, model, extra=STEPS)
    params = [p.detach().clone() for p in model.parameters()]
    rounds = opt.stats()["gossip_rounds"]
    opt.close()
    return {"params": params, "rounds": rounds}


def _rejoin_body(rank: int, world: int, directory: str, mode: str) -> dict:
    from qcomm.sgd import load_checkpoint

    torch.set_num_threads(1)
    model = mlp(123)   # anything: the checkpoint replaces it
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, wait_free=True,
                on_peer_loss="continue", timeout_s=20)
    step = load_checkpoint(directory, opt, model, on_world_size_change=mode)
    loaded = [p.detach().clone() for p in model.parameters()]
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    for s in range(step, step + 2):   # two rounds after the return
        opt.zero_grad()
        mlp_loss(model, (rank + s) % world, s % 8).backward()
        opt.step()
    st = opt.stats()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # A node that closes says goodbye, and a neighbour still stepping counts it out: no rank
    # closes before every rank has read its stats (a barrier on the job's store, which carries
    # no gossip message).
    survivors_meet("stats_read", world)
    opt.close()
    return {"loaded": loaded, "momenta": momenta, "after": after, "live": st["live_nodes"],
            "steps": st["steps"], "rounds": st["gossip_rounds"]}


@pytest.mark.parametrize(("nodes_after", "mode"), [(4, "reinit"), (3, "reinit"), (3, "error")])
def test_a_lost_node_comes_back_at_the_next_restart(tmp_path, nodes_after: int,
                                                    mode: str) -> None:
    """The survivors average and save; the job restarts with the lost node back (4) or without
    it (3): every rank starts from the survivors' average, at their step count. The survivors
    alone (3, ``"error"``: no change allowed) go on with their gossip state as it was."""
    saved = run_world(_save_body, 4, args=(str(tmp_path),), timeout_s=180,
                      allow_exit={VICTIM})
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == \
        ["rank00000.pt", "rank00002.pt", "rank00003.pt"]
    back = run_world(_rejoin_body, nodes_after, args=(str(tmp_path), mode), timeout_s=180)
    survivors = [r for rank, r in enumerate(saved) if rank != VICTIM]
    for rank, r in enumerate(back):
        for a, b in zip(r["loaded"], saved[0]["params"], strict=True):
            assert torch.equal(a, b)   # the returning node too: the survivors' average
        assert r["live"] == nodes_after
        assert r["steps"] == STEPS + 2
        # reinit restarts the gossip's rounds; the survivors alone carry theirs on
        assert r["rounds"] == 2 + (survivors[rank]["rounds"] if mode == "error" else 0)
    if nodes_after == 3:
        return
    # The returning node resumed the lowest survivor's optimizer state too, not one of its own
    # from before the loss: its momentum is rank 0's, bit for bit (the others keep theirs).
    for a, b in zip(back[VICTIM]["momenta"], back[0]["momenta"], strict=True):
        assert torch.equal(a, b)
    others = zip(back[2]["momenta"], back[0]["momenta"], strict=True)
    assert not all(torch.equal(a, b) for a, b in others)
    # and it trains on from there: two steps moved it, as they moved the others
    loaded = torch.cat([p.reshape(-1) for p in back[VICTIM]["loaded"]])
    assert all(not torch.equal(r["after"], loaded) for r in back)
