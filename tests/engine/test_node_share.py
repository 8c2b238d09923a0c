"""The node's ranks all-gather the same fragments of a round, whatever their rails changed.

A wait-free round changes, beside the fragment it mixes, the fragments its rail's neighbours
owed it something in, and those differ between rails; the ranks of a node must still call the
same all-gathers in the same order (each fragment is the same size, so a mismatch would not
fail: it would copy one fragment's values into another), and every rank must end the step
with the same parameters. A node whose ranks joined a running job, each from its own rail's
neighbour, agrees on one clock, one model and one optimizer state."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.engine.joins import NodeJoins
from qcomm.sgd import ASSGD
from tests.engine.problems import mlp, mlp_loss

NODES, PPN, STEPS = 2, 2, 12


def _body(world: MemoryWorld, extra: dict[int, int], out: dict) -> callable:
    def body(rank: int) -> None:
        torch.set_num_threads(1)
        model = mlp(0)
        opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, procs_per_node=PPN,
                    layout=Topology(PPN, rank=rank, world_size=world.world_size, world=world),
                    wait_free=True, sync_every=4, fragments=4, timeout_s=10)
        marks = []
        for step in range(STEPS):
            opt.zero_grad()
            mlp_loss(model, rank // PPN, step).backward()
            if step == 0 or rank not in extra:
                opt.step()
            else:
                node = opt.engine._runtime.node
                gossip, end_step = node.gossip, node.gossip.end_step

                def one_more(x, _end=end_step, _g=gossip):
                    # as a neighbour's owed term would: one more fragment changed on this rail
                    changed = _end(x)
                    if x is not None:
                        f = extra[rank]
                        x[_g.fragment(f)] += 1.0
                        changed = sorted({*changed, f})
                    return changed

                gossip.end_step = one_more
                opt.step()
                gossip.end_step = end_step
            marks.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
        out[rank] = marks
        opt.close()
    return body


def test_ranks_of_a_node_agree_when_their_rails_change_different_fragments() -> None:
    world = MemoryWorld(NODES * PPN, timeout_s=10)
    out: dict[int, list[torch.Tensor]] = {}
    # local rank 0 of each node changes one more fragment than local rank 1 (fragment 0: this
    # small model lies in shard 0's first fragment, the rest of the flat buffer is padding)
    world.run(_body(world, {0: 0, 2: 0}, out))
    for node in range(NODES):
        a, b = out[node * PPN], out[node * PPN + 1]
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), (node, step)
    # the extra change reached the other rank of the node: its steps moved by the 1.0 added
    assert all((x - y).abs().max() >= 0.5 for x, y in zip(out[1][1:], out[1][:-1], strict=False))



def _trained(world: MemoryWorld, rank: int) -> tuple[torch.nn.Module, ASSGD]:
    """Four wait-free steps of a 2x2 job whose shards both hold parameters (74 elements, 64 a
    shard)."""
    torch.set_num_threads(1)
    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.05, momentum=0.9, procs_per_node=PPN,
                layout=Topology(PPN, rank=rank, world_size=world.world_size, world=world),
                wait_free=True, sync_every=2, fragments=1, block_size=32, timeout_s=10)
    for step in range(4):
        opt.zero_grad()
        mlp_loss(model, rank // PPN, step).backward()
        opt.step()
    return model, opt


def _share_body(world: MemoryWorld, out: dict) -> callable:
    def body(rank: int) -> None:
        model, opt = _trained(world, rank)
        node = opt.engine._runtime.node
        with torch.no_grad():   # each rank as if started from a neighbour of its own
            for p in model.parameters():
                p.fill_(float(rank + 1))
        node.share_own_shard()
        out[rank] = (torch.cat([p.detach().flatten() for p in model.parameters()]).clone(),
                     node.flat.shard_numel)
        opt.close()
    return body


def test_after_a_join_each_rank_keeps_its_own_shard_and_takes_the_others_from_its_node() -> None:
    """A node's ranks that each took their rail's neighbour's state (a join) end with one
    model: shard l as local rank l held it."""
    world = MemoryWorld(NODES * PPN, timeout_s=10)
    out: dict[int, tuple[torch.Tensor, int]] = {}
    world.run(_share_body(world, out))
    numel = out[0][0].numel()
    per = out[0][1]
    assert per < numel    # both shards hold parameters (74 elements, 64 a shard)
    for node in range(NODES):
        want = torch.full((numel,), float(node * PPN + 1))
        want[per:] = float(node * PPN + 2)
        for local in range(PPN):
            assert torch.equal(out[node * PPN + local][0], want), (node, local)


def _one_node_body(world: MemoryWorld, out: dict) -> callable:
    def body(rank: int) -> None:
        model, opt = _trained(world, rank)
        node = opt.engine._runtime.node
        # as if each rank had taken its own rail's neighbour's state, a few steps apart
        node.gossip.restart_clock(node.gossip.steps + 3 * rank)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(rank + 1))
                opt.optimizer.state[p]["momentum_buffer"].fill_(float(10 * (rank + 1)))
        seat = SimpleNamespace(local_rank=rank % PPN, node=rank // PPN, incarnation=2,
                               timeout_s=10.0, store=dist.HashStore)
        NodeJoins(seat, node, None, opt.optimizer)._one_node()
        out[rank] = {"steps": opt.engine.steps,
                     "momentum": [opt.optimizer.state[p]["momentum_buffer"].clone()
                                  for p in model.parameters()],
                     "params": torch.cat([p.detach().flatten() for p in model.parameters()])}
        opt.close()
    return body


def test_a_joining_node_agrees_on_one_clock_one_model_and_one_optimizer_state() -> None:
    """Each rank of a joining node took its rail's neighbour's state at its own step: after
    the node's agreement every rank holds the latest step, shard l from local rank l and local
    rank 0's optimizer state, bit for bit."""
    world = MemoryWorld(NODES * PPN, timeout_s=10)
    out: dict[int, dict] = {}
    world.run(_one_node_body(world, out))
    for node in range(NODES):
        ranks = [node * PPN + local for local in range(PPN)]
        assert len({out[r]["steps"] for r in ranks}) == 1
        assert out[ranks[0]]["steps"] == max(out[r]["steps"] for r in ranks)
        for r in ranks:
            assert torch.equal(out[r]["params"], out[ranks[0]]["params"])
            for m in out[r]["momentum"]:
                assert torch.equal(m, torch.full_like(m, 10.0 * (ranks[0] + 1)))
    assert out[0]["steps"] == out[1]["steps"] and out[0]["params"][0] == 1.0   # rank 0's
    assert out[0]["params"][-1] == 2.0                                           # rank 1's
