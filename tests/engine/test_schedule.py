"""Gossip every H steps in F fragments (``sync_every``, ``fragments``) and the outer momentum:
the schedule, the bytes it sends, consensus while training, exact averaging and resume."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.engine.flat import FlatParams
from qcomm.sgd import HierarchicalOptimizer
from tests.engine.problems import mlp, mlp_loss

LAYOUTS = [(2, 2), (4, 1)]


def _opt(model: torch.nn.Module, rank: int, world: MemoryWorld | None, ppn: int,
         **comm) -> HierarchicalOptimizer:
    layout = None if world is None else Topology(ppn, rank=rank, world_size=world.world_size,
                                                 world=world)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        # The outer momentum's machinery is what these tests check, with AdamW as the inner
        # optimizer; that it hurts AdamW's quality (the warning) is not their subject.
        warnings.filterwarnings("ignore", r"outer_momentum=.* around AdamW", UserWarning)
        return HierarchicalOptimizer(inner, layout=layout, procs_per_node=ppn, seed=2, **comm)


def _train(model, opt, rank: int, steps: range, data_rank: int | None = None) -> None:
    for step in steps:
        opt.zero_grad()
        mlp_loss(model, rank if data_rank is None else data_rank, step).backward()
        opt.step()


@pytest.mark.parametrize(("nodes", "ppn"), LAYOUTS)
@pytest.mark.parametrize(("h", "f"), [(8, 4), (4, 1), (6, 3)])
def test_each_fragment_once_per_h_steps_and_bytes_per_step(nodes: int, ppn: int, h: int,
                                                           f: int) -> None:
    world = MemoryWorld(nodes * ppn, timeout_s=30)
    steps = 3 * h

    def body(rank: int) -> tuple[dict, int]:
        model = mlp(0)
        opt = _opt(model, rank, world, ppn, sync_every=h, fragments=f)
        _train(model, opt, rank, range(steps))
        st = opt.stats()
        shard = opt.engine._runtime.node.flat.shard_numel
        opt.close()
        return st, shard

    spec = QuantSpec(4, 128, "stochastic")
    degree = 1 if nodes == 2 else 2  # ring
    for st, shard in world.run(body):
        assert st["fragment_rounds"] == [steps // h] * f
        assert st["gossip_rounds"] == steps * f // h
        per_message = packed_nbytes(shard // f, spec) + SEAL_NBYTES
        assert st["bytes_sent"]["inter"] == st["gossip_rounds"] * per_message * degree
        # Per step: one fragment's payload to each neighbour every H/F steps.
        assert st["bytes_sent"]["inter"] / steps == per_message * degree / (h // f)


def _trajectory(rank: int, world: MemoryWorld | None, ppn: int, steps: int,
                data_rank: int | None = None, **comm) -> dict:
    model = mlp(0)
    opt = _opt(model, rank, world, ppn, **comm)
    distances = []
    for step in range(steps):
        _train(model, opt, rank, range(step, step + 1), data_rank)
        if step % 10 == 9 and world is not None and world.world_size > ppn:
            distances.append(opt.stats(consensus=True)["consensus_distance"])
    own = [p.detach().clone() for p in model.parameters()]
    opt.average_parameters()
    avg = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return {"own": own, "avg": avg, "distances": distances}


@pytest.mark.parametrize(("nodes", "ppn"), LAYOUTS)
def test_consensus_bounded_and_average_exact(nodes: int, ppn: int) -> None:
    world = MemoryWorld(nodes * ppn, timeout_s=30)
    steps = 120
    res = world.run(lambda r: _trajectory(r, world, ppn, steps, sync_every=8, fragments=4))
    # The same nodes without any communication between them (one world per node).
    alone = []
    for n in range(nodes):
        w = MemoryWorld(ppn, timeout_s=30)
        alone.append(w.run(lambda r, n=n, w=w: _trajectory(r, w, ppn, steps,
                                                           data_rank=n * ppn + r))[0]["own"])
    flat = [torch.cat([p.reshape(-1) for p in ps]).double() for ps in alone]
    mean = torch.stack(flat).mean(dim=0)
    drift_alone = float(torch.stack([(x - mean).norm() ** 2 for x in flat]).mean().sqrt())
    for r in res:
        # Nodes train on different data between rounds, so they drift apart; gossip keeps
        # them together: after the first rounds, well under the drift without communication
        # (measured: 0.37-0.56 of it at 2 x 2, 0.34-0.48 at 4 x 1), and not growing.
        d = r["distances"]
        assert max(d[1:]) < 0.6 * drift_alone, (d, drift_alone)
        assert max(d[len(d) // 2:]) <= max(d[: len(d) // 2]), d
    # average_parameters: every rank holds the mean of the nodes' own parameters.
    for i in range(len(res[0]["own"])):
        nodes_own = torch.stack([res[n * ppn]["own"][i] for n in range(nodes)]).double()
        mean = nodes_own.mean(dim=0)
        for r in res:
            assert torch.allclose(r["avg"][i].double(), mean, rtol=0, atol=1e-6)
            assert torch.equal(r["avg"][i], res[0]["avg"][i])


@pytest.mark.parametrize(("nodes", "ppn"), LAYOUTS)
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_resume_mid_period_is_bit_exact(nodes: int, ppn: int, momentum: float) -> None:
    world = MemoryWorld(nodes * ppn, timeout_s=30)
    comm = dict(sync_every=8, fragments=4, staleness=2, outer_momentum=momentum)

    def body(rank: int) -> bool:
        full = mlp(0)
        opt = _opt(full, rank, world, ppn, **comm)
        _train(full, opt, rank, range(13))  # mid-period, rounds in flight
        # state_dict() holds references (as torch's do): copy before training on.
        saved = copy.deepcopy((opt.state_dict(), full.state_dict()))
        _train(full, opt, rank, range(13, 30))
        opt.close()
        resumed = mlp(7)
        opt2 = _opt(resumed, rank, world, ppn, **comm)
        resumed.load_state_dict(saved[1])
        opt2.load_state_dict(saved[0])
        _train(resumed, opt2, rank, range(13, 30))
        opt2.close()
        return all(torch.equal(a, b) for a, b in
                   zip(full.parameters(), resumed.parameters(), strict=True))

    assert all(world.run(body))


@pytest.mark.parametrize(("nodes", "ppn"), LAYOUTS)
def test_copying_only_the_fragments_a_round_reads_changes_nothing(nodes: int, ppn: int,
                                                                   monkeypatch) -> None:
    """A fragmented round copies in only the fragments it sends and mixes (and out only the
    one it mixed); the same training with every round copying all parameters in and out gives
    the same bits."""
    comm = dict(sync_every=8, fragments=4, staleness=2, outer_momentum=0.5)

    def run() -> list[list[torch.Tensor]]:
        world = MemoryWorld(nodes * ppn, timeout_s=30)
        return world.run(lambda r: _trajectory(r, world, ppn, 30, **comm)["own"])

    by_range = run()
    init = FlatParams.__init__

    def whole_copies(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.ranges_ok = False  # what a non-contiguous parameter makes the engine do

    monkeypatch.setattr(FlatParams, "__init__", whole_copies)
    whole = run()
    for a, b in zip(by_range, whole, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_schedule_options_are_validated_by_name() -> None:
    model = mlp(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fragments must be an int >= 1 dividing sync_every=8, "
                                         "got 3"):
        HierarchicalOptimizer(inner, sync_every=8, fragments=3)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        HierarchicalOptimizer(inner, sync_every=0)
    with pytest.raises(TypeError, match="fragments must be an int"):
        HierarchicalOptimizer(inner, fragments=2.0)
    with pytest.raises(ValueError, match=r"outer_momentum must be a float in \[0, 1\)"):
        HierarchicalOptimizer(inner, outer_momentum=1.0)


def _gloo_body(rank: int, world: int) -> list:
    return [p.numpy() for p in _trajectory(rank, None, 2, 24, sync_every=8, fragments=4,
                                           outer_momentum=0.5)["own"]]


def test_fragmented_gossip_over_gloo_matches_in_memory(gloo) -> None:
    over_gloo = gloo.run(_gloo_body, 4)
    world = MemoryWorld(4, timeout_s=30)
    threads = torch.get_num_threads()
    try:
        in_memory = world.run(lambda r: _trajectory(r, world, 2, 24, sync_every=8, fragments=4,
                                                    outer_momentum=0.5)["own"])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(over_gloo, in_memory, strict=True):
        assert all((x == y.numpy()).all() for x, y in zip(a, b, strict=True))


def test_full_consensus_step_with_too_few_fragments_warns() -> None:
    model = mlp(0)
    with pytest.warns(UserWarning, match=r"gamma=1.0 with staleness=1 >= fragments=1") as rec:
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), gamma=1.0)
    assert rec[0].filename == __file__  # points at the caller's line, not at qcomm
    with pytest.warns(UserWarning, match=r"staleness=2 >= fragments=2"):
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), gamma=0.6, staleness=2,
                              sync_every=2, fragments=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Each fragment's correction lands before it is sent again, or the step is small.
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), gamma=1.0,
                              sync_every=2, fragments=2)
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), gamma=1.0, staleness=0)
        HierarchicalOptimizer(torch.optim.AdamW(model.parameters()), gamma=0.5)
