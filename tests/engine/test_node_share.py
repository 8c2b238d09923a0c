"""The node's ranks all-gather the same fragments of a round, whatever their rails changed.

A wait-free round changes, beside the fragment it mixes, the fragments its rail's neighbours
owed it something in, and those differ between rails; the ranks of a node must still call the
same all-gathers in the same order (each fragment is the same size, so a mismatch would not
fail: it would copy one fragment's values into another), and every rank must end the step
with the same parameters."""

from __future__ import annotations

import torch

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
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
                node = opt.engine._node
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

