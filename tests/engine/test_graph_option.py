"""The gossip graph as an option of the engine: ``graph="one-peer-exp"`` through the optimizers'
keyword (lockstep), over Gloo with the bits and bytes of the in-memory world, one message per
node and round; the graph chosen by the node count when none is named (the ring, bit for bit,
up to 6 nodes; the one-peer graph from 7, in both modes), said in the layout line; bad values
refused before anything is built."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from qcomm.collectives.gossip.choco import CompressedGossip
from qcomm.collectives.gossip.graph_choice import ONE_PEER_FROM, choose_graph
from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.gossip.one_peer_choco import OnePeerGossip
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.memory import GossipSimulator, MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.sgd import ASSGD
from tests.engine.problems import mlp, mlp_loss

STEPS = 12
KW = dict(lr=0.05, momentum=0.9, bits=4, staleness=1, seed=5, procs_per_node=1, timeout_s=60)


def _train(rank: int, layout: Topology | None, steps: int, **comm) -> dict:
    torch.set_num_threads(1)
    model = mlp(rank)   # every node starts elsewhere: the gossip has something to mix
    opt = ASSGD(model.parameters(), layout=layout, **{**KW, **comm})
    for step in range(steps):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
    kind = type(opt.engine._runtime.node.gossip)
    st = opt.stats()
    opt.close()
    return {"params": [p.detach().clone().numpy() for p in model.parameters()],
            "bytes": st["bytes_sent"], "messages": st["messages_sent"], "kind": kind.__name__}


def _gloo_body(rank: int, world: int, steps: int) -> dict:
    return _train(rank, None, steps, graph="one-peer-exp")


def _in_memory(n: int, body) -> list:
    world = MemoryWorld(n, timeout_s=60)
    threads = torch.get_num_threads()
    try:
        return world.run(lambda r: body(r, Topology(1, rank=r, world_size=n, world=world)),
                         timeout_s=240)
    finally:
        torch.set_num_threads(threads)


def test_four_nodes_over_gloo_give_the_bits_and_bytes_of_the_in_memory_world(gloo) -> None:
    over_gloo = gloo.run(_gloo_body, 4, args=(STEPS,))
    in_memory = _in_memory(4, lambda r, layout: _train(r, layout, STEPS, graph="one-peer-exp"))
    numel = sum(p.numel() for p in mlp(0).parameters())   # 74: one 128-float block
    message = packed_nbytes(-(-numel // 128) * 128, QuantSpec(4, 128, "stochastic")) \
        + SEAL_NBYTES
    for a, b in zip(over_gloo, in_memory, strict=True):
        assert a["kind"] == b["kind"] == "OnePeerGossip"
        assert a["bytes"] == b["bytes"]
        # 4 nodes: every node has a partner every round, one message each (the ring: two)
        assert a["messages"]["inter"] == STEPS and a["bytes"]["inter"] == STEPS * message
        for x, y in zip(a["params"], b["params"], strict=True):
            assert (x == y).all()
    ring = _in_memory(4, lambda r, layout: _train(r, layout, STEPS, graph="ring"))
    assert ring[0]["messages"]["inter"] == 2 * STEPS
    assert not all((x == y).all() for x, y in zip(ring[0]["params"], in_memory[0]["params"],
                                                   strict=True))


def _consensus(rank: int, layout: Topology, steps: int, average: bool = False, **comm) -> dict:
    """lr 0: the gossip alone moves the parameters (the optimizer's own step is zero).
    ``average``: end with the exact average (drained, what is owed settled)."""
    torch.set_num_threads(1)
    model = mlp(rank)
    opt = ASSGD(model.parameters(), layout=layout, **{**KW, "lr": 0.0, **comm})
    for step in range(steps):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
    kind = type(opt.engine._runtime.node.gossip)
    st = opt.stats(consensus=True)
    if average:
        opt.average_parameters()
    opt.close()
    return {"end": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "kind": kind, "distance": st["consensus_distance"], "graph": opt.comm.graph}


def test_eight_nodes_choose_the_one_peer_graph_keep_the_mean_and_reach_consensus() -> None:
    n, steps = 8, 60
    res = _in_memory(n, lambda r, layout: _consensus(r, layout, steps))
    start = torch.stack([torch.cat([p.detach().reshape(-1) for p in mlp(r).parameters()])
                         for r in range(n)])
    end = torch.stack([r["end"] for r in res])
    assert all(r["kind"] is OnePeerGossip and r["graph"] is None for r in res)
    d0 = GossipSimulator.consensus_distance(list(start))
    assert res[0]["distance"] < 1e-2 * d0
    drift = float((end.double().mean(0) - start.double().mean(0)).abs().max())
    assert drift <= 2 * steps * 2.0**-24 * float(start.abs().max())


@pytest.mark.parametrize("loss", ["raise", "continue"])
def test_eight_wait_free_nodes_choose_the_one_peer_graph_and_their_exact_average_is_the_mean(
        loss: str) -> None:
    # "continue": the average and the distance sum over the survivors (flooding the links)
    n, steps = 8, 40
    res = _in_memory(n, lambda r, layout: _consensus(r, layout, steps, average=True,
                                                     wait_free=True, on_peer_loss=loss))
    start = torch.stack([torch.cat([p.detach().reshape(-1) for p in mlp(r).parameters()])
                         for r in range(n)])
    assert all(r["kind"] is OnePeerWaitFree and r["graph"] is None for r in res)
    assert res[0]["distance"] < 0.05 * GossipSimulator.consensus_distance(list(start))
    # the mirrors owed settled, the drained average is the start's: mixing moved no mass
    drift = float((res[0]["end"].double() - start.double().mean(0)).abs().max())
    assert drift <= 2 * steps * 2.0**-24 * float(start.abs().max())
    assert all(torch.equal(r["end"], res[0]["end"]) for r in res)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_default_graph_up_to_four_nodes_is_the_ring_bit_for_bit(n: int) -> None:
    default = _in_memory(n, lambda r, layout: _train(r, layout, STEPS))
    ring = _in_memory(n, lambda r, layout: _train(r, layout, STEPS, graph="ring"))
    for a, b in zip(default, ring, strict=True):
        assert a["kind"] == b["kind"] == CompressedGossip.__name__
        assert a["bytes"] == b["bytes"]
        assert all((x == y).all() for x, y in zip(a["params"], b["params"], strict=True))


def test_choose_graph_by_node_count_and_mode() -> None:
    # both modes alike
    assert [choose_graph(None, n)[0] for n in (1, 2, 4, 6)] == ["ring"] * 4
    assert ONE_PEER_FROM == 7
    assert [choose_graph(None, n)[0] for n in (7, 8, 1024)] == ["one-peer-exp"] * 3
    why = choose_graph(None, 8)[1]
    assert why == ("8 nodes: one message per node and round, rounds to consensus grow as "
                   "log2 N (the ring's as N^2)")
    assert choose_graph("exponential", 64) == ("exponential", "as the options name it")
    assert choose_graph("ring", 64)[0] == "ring"
    with pytest.raises(ValueError, match="num_nodes must be an int >= 1, got 0"):
        choose_graph(None, 0)


@pytest.mark.parametrize(("n", "text"), [
    (8, "over a one-peer-exp graph (8 nodes: one message per node and round, rounds to "
        "consensus grow as log2 N (the ring's as N^2)), each local rank carrying 1/1 of them "
        "on its rail; gossip every step, staleness 1, gamma 0.55"),   # the one-peer default
    (4, "over a ring graph (4 nodes: the default below 7, where it reaches consensus in as "
        "few rounds as the one-peer graph), each local rank carrying 1/1 of them on its "
        "rail; gossip every step, staleness 1, gamma 0.3"),
])
def test_the_layout_line_says_which_graph_and_why(caplog: pytest.LogCaptureFixture, n: int,
                                                  text: str) -> None:
    with caplog.at_level(logging.INFO, logger="qcomm"):
        _in_memory(n, lambda r, layout: _train(r, layout, 2))
    records = [r.message for r in caplog.records if r.name == "qcomm"]
    assert len(records) == 1 and text in records[0], records


def test_a_named_graph_is_said_as_named() -> None:
    from qcomm.engine.options import CommOptions
    from qcomm.engine.report import topology_line

    _, line = topology_line(Topology(1, rank=0, world_size=8),
                            CommOptions(graph="exponential"), False, 10)
    assert "over a exponential graph (as the options name it)" in line
    _, line = topology_line(Topology(1, rank=0, world_size=8), CommOptions(wait_free=True),
                            False, 10)
    assert "over a one-peer-exp graph (8 nodes: one message per node and round" in line
    assert "wait-free on the one-peer graph" in line
    _, line = topology_line(Topology(1, rank=0, world_size=6), CommOptions(wait_free=True),
                            False, 10)
    assert "over a ring graph (6 nodes: the default below 7" in line


@pytest.mark.parametrize(("comm", "match"), [
    (dict(graph="star"), r"graph must be one of \('ring', 'exponential', 'complete', "
                         r"'one-peer-exp'\) or None, got 'star'"),
])
def test_a_bad_graph_is_refused_by_the_optimizer_before_anything_is_built(comm: dict,
                                                                         match: str) -> None:
    model = mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        ASSGD(model.parameters(), lr=0.1, **comm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _save_and_resume(rank: int, layout_of, steps: int, **comm) -> dict:
    """``steps`` steps, a checkpoint (deep copies), ``steps`` more; then a new model and
    optimizer loaded from the checkpoint take the same ``steps`` more."""
    torch.set_num_threads(1)
    model = mlp(rank)
    opt = ASSGD(model.parameters(), layout=layout_of(), **{**KW, **comm})

    def train(m: torch.nn.Module, o: ASSGD, first: int) -> None:
        for step in range(first, first + steps):
            o.zero_grad()
            mlp_loss(m, rank, step).backward()
            o.step()

    train(model, opt, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, steps)
    kind = type(opt.engine._runtime.node.gossip).__name__
    opt.close()
    resumed = mlp(99)
    opt2 = ASSGD(resumed.parameters(), layout=layout_of(), **{**KW, **comm})
    resumed.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(resumed, opt2, steps)
    opt2.close()
    return {"kind": kind, "same": all(torch.equal(a, b) for a, b in
                                      zip(model.parameters(), resumed.parameters(), strict=True))}


@pytest.mark.parametrize("comm", [{}, {"graph": "one-peer-exp"}], ids=["by-count", "named"])
def test_eight_nodes_resume_from_a_checkpoint_with_the_bits_of_a_run_never_stopped(
        comm: dict) -> None:
    world = MemoryWorld(8, timeout_s=60)
    layout_of = lambda r: lambda: Topology(1, rank=r, world_size=8, world=world)
    threads = torch.get_num_threads()
    try:
        res = world.run(lambda r: _save_and_resume(r, layout_of(r), 5, **comm), timeout_s=240)
    finally:
        torch.set_num_threads(threads)
    assert all(r["kind"] == "OnePeerGossip" and r["same"] for r in res), res


def test_a_checkpoint_compares_the_graph_each_run_gossips_over() -> None:
    from qcomm.engine.options import CommOptions
    from qcomm.engine.state import check_loadable

    def entry(nodes: int, **comm) -> dict:
        return {"format": 2, "world_size": nodes, "procs_per_node": 1, "rank": 0,
                "comm": CommOptions(**comm).as_dict(), "gossip": None}

    at = lambda nodes: Topology(1, rank=0, world_size=nodes)
    # the graph a default run gossips over: the ring at 4 nodes, the one-peer graph at 8
    assert check_loadable(entry(4, graph="ring"), CommOptions(), at(4))
    assert check_loadable(entry(8), CommOptions(graph="one-peer-exp"), at(8))
    with pytest.raises(ValueError, match=r"'graph': 'ring'.*'graph': 'one-peer-exp'"):
        check_loadable(entry(8, graph="ring"), CommOptions(), at(8))
