"""CompressedGossip over real Gloo process groups (3, 4, 5 and 2 processes on localhost).

Each behaviour is its own test, run in a session-wide Gloo world (the ``gloo`` fixture); a peer
that dies or hangs on purpose gets a world of its own (``run_world``). The in-process simulator
(tests/collectives/test_gossip_sim.py covers the full bits x staleness x graph matrix) must give
the very same bits as the multi-process run: that is asserted here, so the simulator's
convergence results carry over to Gloo.

Results come back as numpy arrays, not tensors: torch.multiprocessing ships tensors through a
queue as shared-memory handles that the parent fetches from the child, which may have exited by
then (ConnectionResetError in run_world).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives import PeerError
from qcomm.collectives.gossip import (
    CompressedGossip,
    consensus_distance,
    neighbours,
)
from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.memory import GossipSimulator
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.multiprocess import run_world
from tests.worlds import survivors_meet

NUMEL = 1000  # not a multiple of the block: the last block is partial
ROUNDS = 20


def _start(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


def _run_case(ranks: list[int], group: dist.ProcessGroup | None, member: int, bits: int,
              tau: int, graph: str) -> dict:
    """ROUNDS steps on this member's x; returns x, distances and byte counts."""
    x = _start(len(ranks))[member].clone()
    gs = CompressedGossip(ranks, group, NUMEL, graph=graph, spec=QuantSpec(bits, 128,
                          "stochastic"), staleness=tau, timeout_s=30.0, seed=7)
    dists = [consensus_distance(x, group)]
    per_round = []
    for _ in range(ROUNDS):
        before = gs.stats.snapshot()["bytes_sent"]["inter"]
        gs.step(x)
        per_round.append(gs.stats.snapshot()["bytes_sent"]["inter"] - before)
        dists.append(consensus_distance(x, group))
    gs.flush()  # nothing left in flight for the next test that runs in this world
    gs.close()
    return {"x": x.numpy(), "dists": dists, "per_round": per_round, "gamma": gs.gamma,
            "intra": gs.stats.snapshot()["bytes_sent"]["intra"]}


def _simulate(n: int, bits: int, tau: int, graph: str) -> tuple[list[torch.Tensor], list[float]]:
    xs = [x.clone() for x in _start(n)]
    sim = GossipSimulator(n, NUMEL, graph=graph, spec=QuantSpec(bits, 128, "stochastic"),
                          staleness=tau, seed=7)
    dists = [sim.consensus_distance(xs)]
    for _ in range(ROUNDS):
        sim.step(xs)
        dists.append(sim.consensus_distance(xs))
    return xs, dists


def _check_against_sim(results: list[dict], n: int, bits: int, tau: int, graph: str) -> None:
    xs, dists = _simulate(n, bits, tau, graph)
    for i, r in enumerate(results):
        assert torch.equal(torch.from_numpy(r["x"]), xs[i]), f"member {i} differs from the sim"
        # Same values; the distributed sum runs in another order: float64 rounding only.
        assert r["dists"] == pytest.approx(dists, rel=1e-9, abs=1e-12)
        # Bytes per round: (packed_nbytes(shard) + the seal) x number of neighbours.
        want = (packed_nbytes(NUMEL, QuantSpec(bits, 128, "stochastic")) + SEAL_NBYTES) * len(
            neighbours(graph, i, n))
        assert r["per_round"] == [want] * ROUNDS
        assert r["intra"] == 0
    assert dists[-1] < dists[0]


# ---------------------------------------------------------------------------------------------
# 3 processes: odd count, default group, several configurations, bad inputs

CASES_3 = [(8, 0, "ring"), (4, 1, "ring"), (2, 2, "ring"), (1, 1, "exponential")]


def _case_body(rank: int, world: int, bits: int, tau: int, graph: str) -> dict:
    return _run_case(list(range(world)), None, rank, bits, tau, graph)


@pytest.mark.parametrize("case", CASES_3, ids=lambda c: f"{c[0]}bit-tau{c[1]}-{c[2]}")
def test_three_nodes_match_the_simulator_bit_for_bit(gloo, case) -> None:
    _check_against_sim(gloo.run(_case_body, 3, args=case), 3, *case)


def _bad_groups_body(rank: int, world: int) -> dict:
    errors = {}
    bad_groups = {"order": [0, 2, 1], "short": [0, 1], "dup": [0, 0, 1], "empty": []}
    for name, ranks in bad_groups.items():
        try:
            CompressedGossip(ranks, None, NUMEL)
        except ValueError as e:
            errors[name] = str(e)
    sub = dist.new_group([0, 1])  # collective on every rank
    if rank < 2:
        try:
            CompressedGossip([0, 2], sub, NUMEL)
        except ValueError as e:
            errors["sub"] = str(e)
    return errors


def test_group_ranks_must_match_the_group(gloo) -> None:
    res = gloo.run(_bad_groups_body, 3)
    for r in res:
        assert set(r) >= {"order", "short", "dup", "empty"}
        assert all("group_ranks" in msg for msg in r.values())
    assert all("sub" in r for r in res[:2])


# ---------------------------------------------------------------------------------------------
# 4 processes: a sub-group with non-trivial global ranks, exponential graph; resume mid-run


def _subgroup_body(rank: int, world: int) -> dict | None:
    members = [1, 2, 3]  # rank 0 sits out: group ranks != global ranks
    sub = dist.new_group(members)  # collective on every rank
    out = _run_case(members, sub, members.index(rank), 4, 2, "ring") if rank in members \
        else None
    dist.barrier()
    return out


def test_subgroup_with_other_global_ranks(gloo) -> None:
    res = gloo.run(_subgroup_body, 4)
    _check_against_sim(res[1:], 3, 4, 2, "ring")


def test_four_nodes_exponential_graph(gloo) -> None:
    _check_against_sim(gloo.run(_case_body, 4, args=(2, 1, "exponential")), 4, 2, 1,
                       "exponential")


def _resume_body(rank: int, world: int) -> object:
    """Resume with rounds in flight: 9 steps, checkpoint, a new instance, the rest."""
    spec = QuantSpec(4, 128, "stochastic")
    x = _start(world)[rank].clone()
    gs = CompressedGossip(list(range(world)), None, NUMEL, spec=spec, staleness=2, seed=7)
    for _ in range(9):
        gs.step(x)
    state = gs.state_dict()
    assert len(state["in_flight"]) == 2
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    gs.close()
    gs2 = CompressedGossip(list(range(world)), None, NUMEL, spec=spec, staleness=2, seed=7)
    gs2.load_state_dict(state)
    for _ in range(ROUNDS - 9):
        gs2.step(x)
    gs2.flush()
    gs2.close()
    return x.numpy()


def test_resume_with_rounds_in_flight_is_bit_exact(gloo) -> None:
    res = gloo.run(_resume_body, 4)
    xs, _ = _simulate(4, 4, 2, "ring")
    for i, r in enumerate(res):
        assert torch.equal(torch.from_numpy(r), xs[i])


# ---------------------------------------------------------------------------------------------
# 5 and 2 processes: odd count without deadlock; a pair has one neighbour


@pytest.mark.parametrize(("world", "case"), [(5, (4, 2, "ring")), (2, (8, 0, "ring"))])
def test_five_and_two_nodes(gloo, world: int, case: tuple[int, int, str]) -> None:
    _check_against_sim(gloo.run(_case_body, world, args=case), world, *case)


# ---------------------------------------------------------------------------------------------
# a peer that dies or hangs: PeerLostError / PeerTimeoutError on the others, naming it and the
# link, within the timeout plus a margin

TIMEOUT_S = 3.0
MARGIN_S = 2.0  # scheduling slack on a loaded 2-core CI machine


def _world_fail(rank: int, world: int, how: str) -> dict | None:
    x = _start(world)[rank].clone()
    gs = CompressedGossip(list(range(world)), None, NUMEL, staleness=1, timeout_s=TIMEOUT_S)
    for _ in range(5):
        gs.step(x)
    if rank == world - 1:
        if how == "exit":
            os._exit(3)  # killed: no clean-up, sockets closed by the kernel
        time.sleep(TIMEOUT_S + MARGIN_S + 2)  # hung: alive but silent
        gs.close()
        return None
    t0 = time.monotonic()
    try:
        for _ in range(100):
            gs.step(x)
    except PeerError as e:
        elapsed = time.monotonic() - t0
        t1 = time.monotonic()
        gs.close()  # must not hang on a broken group
        out = {"peers": e.peers, "type": type(e).__name__, "link": e.link,
               "timeout": getattr(e, "timeout_s", None), "msg": str(e), "elapsed": elapsed,
               "close_s": time.monotonic() - t1, "rounds": gs.rounds_started}
    else:
        out = {"peers": None}
    survivors_meet("world_fail", world - 1)
    return out


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_or_silent_peer_raises_timeout(how: str) -> None:
    world = 3
    res = run_world(_world_fail, world, args=(how,), timeout_s=120,
                    allow_exit={world - 1} if how == "exit" else None)
    for r in res[:-1]:
        assert r["peers"] == [world - 1], r
        assert r["link"] == "inter" and "gossip round" in r["msg"]
        assert f"ranks [{world - 1}]" in r["msg"] and "inter-node link" in r["msg"]
        assert r["elapsed"] <= TIMEOUT_S + MARGIN_S
        if how == "hang":  # nobody closed a socket: only the timeout can have fired
            assert r["type"] == "PeerTimeoutError" and r["timeout"] == TIMEOUT_S
            assert f"{TIMEOUT_S:g} s" in r["msg"]
            assert r["elapsed"] >= TIMEOUT_S - 0.1
        else:  # the kernel closed the dead peer's sockets: the connection is reported lost
            assert r["type"] == "PeerLostError" and "lost" in r["msg"], r
        assert r["close_s"] < 0.5
