"""The averaging engine with ranks as threads of this process (in-memory groups): the same bytes
as over Gloo, and the behaviours that need several ranks but no sockets."""

from __future__ import annotations

import logging

import pytest
import torch

from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.sgd import HierarchicalOptimizer
from tests.engine.problems import mlp, mlp_loss

LAYOUTS = [(2, 2), (4, 1)]  # (nodes, ranks per node)


def _layout(world: MemoryWorld, rank: int, ppn: int) -> Topology:
    return Topology(ppn, rank=rank, world_size=world.world_size, world=world)


def _adamw(model: torch.nn.Module, layout: Topology | None, **comm) -> HierarchicalOptimizer:
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return HierarchicalOptimizer(inner, layout=layout, procs_per_node=2, staleness=1, seed=5,
                                 **comm)


def _run_mlp(rank: int, layout: Topology | None, steps: int) -> dict:
    torch.set_num_threads(1)
    model = mlp(0)
    opt = _adamw(model, layout)
    for step in range(steps):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
    st = opt.stats()
    opt.close()
    return {"params": [p.detach().clone().numpy() for p in model.parameters()],
            "bytes": st["bytes_sent"]}


def _gloo_body(rank: int, world: int, steps: int) -> dict:
    return _run_mlp(rank, None, steps)


def test_in_memory_engine_sends_the_bytes_of_gloo(gloo) -> None:
    steps = 12
    over_gloo = gloo.run(_gloo_body, 4, args=(steps,))
    threads = torch.get_num_threads()
    world = MemoryWorld(4, timeout_s=30)
    try:
        in_memory = world.run(lambda r: _run_mlp(r, _layout(world, r, 2), steps))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(over_gloo, in_memory, strict=True):
        assert a["bytes"] == b["bytes"] and a["bytes"]["inter"] > 0
        for x, y in zip(a["params"], b["params"], strict=True):
            assert (x == y).all()


# ---------------------------------------------------------------------------------------------


class _WithFrozen(torch.nn.Module):
    """An MLP plus a frozen parameter and a parameter that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(0)
        gen = torch.Generator().manual_seed(1)
        self.frozen = torch.nn.Parameter(torch.randn(40, generator=gen), requires_grad=False)
        self.unused = torch.nn.Parameter(torch.randn(30, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.frozen[:2]


@pytest.mark.parametrize(("nodes", "ppn"), LAYOUTS)
def test_frozen_and_gradless_parameters_stay_bit_identical(nodes: int, ppn: int) -> None:
    world = MemoryWorld(nodes * ppn, timeout_s=30)

    def body(rank: int) -> dict:
        model = _WithFrozen()
        frozen, unused = model.frozen.detach().clone(), model.unused.detach().clone()
        opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                    layout=_layout(world, rank, ppn), procs_per_node=ppn)
        first = model.net[0].weight.detach().clone()
        gen = torch.Generator().manual_seed(rank)
        for _ in range(50):
            opt.zero_grad()
            x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return {"frozen": torch.equal(frozen, model.frozen),
                "unused": torch.equal(unused, model.unused),
                "moved": not torch.equal(first, model.net[0].weight),
                "communicated": opt.engine._runtime.node.flat.numel,
                "rounds": opt.stats()["gossip_rounds"]}

    for r in world.run(body):
        assert r["frozen"] and r["unused"] and r["moved"]
        # The frozen parameter is not part of what crosses the links; the unused one is.
        assert r["communicated"] == sum(p.numel() for p in mlp(0).parameters()) + 30
        assert r["rounds"] == 50


def test_stats_survive_a_resume() -> None:
    world = MemoryWorld(4, timeout_s=30)

    def body(rank: int) -> tuple[dict, dict]:
        model = mlp(0)
        opt = _adamw(model, _layout(world, rank, 2))
        for step in range(5):
            opt.zero_grad()
            mlp_loss(model, rank, step).backward()
            opt.step()
        before = opt.stats()
        state = opt.state_dict()
        opt.close()
        resumed = _adamw(mlp(0), _layout(world, rank, 2))
        resumed.load_state_dict(state)
        return before, resumed.stats()

    for before, after in world.run(body):
        assert before["bytes_sent"]["inter"] > 0 and before["messages_sent"]["intra"] > 0
        for key in ("steps", "bytes_sent", "messages_sent", "skipped_steps"):
            assert before[key] == after[key], key


def test_skip_with_intra_bits_is_a_true_noop() -> None:
    """A NaN on one rank with on_nonfinite="skip" and quantized intra-node means: the step is
    as if never taken, error-feedback residuals and call counters included."""
    world = MemoryWorld(4, timeout_s=30)

    def body(rank: int, nan_at: int | None, omit: int | None) -> dict:
        model = mlp(0)
        opt = _adamw(model, _layout(world, rank, 2), intra_bits=4, on_nonfinite="skip")
        for step in range(8):
            if step == omit:
                continue
            opt.zero_grad()
            mlp_loss(model, rank, step).backward()
            if step == nan_at and rank == 1:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
        intra = opt.engine._runtime.intra.state_dict()
        return {"params": [p.detach().clone() for p in model.parameters()],
                "calls": intra["calls"],
                "residuals": {k: v.clone() for k, v in
                              intra["error_feedback"]["residuals"].items()},
                "stats": opt.stats()}

    skipped = world.run(body, 3, None)
    omitted = world.run(body, None, 3)
    for a, b in zip(skipped, omitted, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert a["calls"] == b["calls"] == 7
        assert a["residuals"].keys() == b["residuals"].keys()
        assert all(torch.equal(a["residuals"][k], b["residuals"][k]) for k in a["residuals"])
        assert a["stats"]["skipped_steps"] == 1 and a["stats"]["steps"] == 7
        assert a["stats"]["gossip_rounds"] == b["stats"]["gossip_rounds"] == 7


def test_sync_gradients_gives_node_means_once() -> None:
    """sync_gradients() right after backward: every rank of the node holds the mean (so
    clipping sees it), and step() does not average again."""
    world = MemoryWorld(2, timeout_s=30)

    def body(rank: int) -> dict:
        model = mlp(0)
        opt = _adamw(model, _layout(world, rank, 2))
        mlp_loss(model, rank, 0).backward()
        own = [p.grad.clone() for p in model.parameters()]
        assert opt.sync_gradients()
        synced = [p.grad.clone() for p in model.parameters()]
        bytes_after_sync = opt.stats()["bytes_sent"]["intra"]
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        clipped = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return {"own": own, "synced": synced, "clipped": clipped, "norm": float(total),
                "sync_bytes": bytes_after_sync, "bytes": opt.stats()["bytes_sent"]["intra"],
                "params": [p.detach().clone() for p in model.parameters()]}

    r0, r1 = world.run(body)
    for a, b, s0, s1 in zip(r0["own"], r1["own"], r0["synced"], r1["synced"], strict=True):
        assert torch.equal(s0, s1) and torch.equal(s0, (a + b) / 2)
    assert r0["norm"] == r1["norm"] > 0.01
    assert r0["sync_bytes"] == r0["bytes"] > 0  # step() sent nothing more inside the node
    assert all(torch.equal(x, y) for x, y in zip(r0["params"], r1["params"], strict=True))


def test_unfreezing_after_the_first_step_raises_and_changes_nothing() -> None:
    world = MemoryWorld(2, timeout_s=30)

    def body(rank: int) -> str:
        model = _WithFrozen()
        opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    layout=_layout(world, rank, 1), procs_per_node=1)
        model(torch.ones(3, 6)).sum().backward()
        opt.step()
        model.frozen.requires_grad_(True)
        opt.zero_grad()
        model(torch.ones(3, 6)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except ValueError as e:
            same = all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                        strict=True))
            return f"{e} | unchanged={same}"
        return "no error"

    for msg in world.run(body):
        assert "frozen (requires_grad=False) at the first distributed step" in msg
        assert msg.endswith("unchanged=True")


@pytest.mark.parametrize(("nodes", "ppn", "level", "text"), [
    (1, 4, logging.WARNING, "1 node x 4 ranks"),
    (2, 2, logging.INFO, "2 nodes x 2 ranks"),
    (2, 1, logging.INFO, "2 nodes x 1 rank;"),
])
def test_detected_layout_is_logged_once(caplog: pytest.LogCaptureFixture, nodes: int, ppn: int,
                                        level: int, text: str) -> None:
    world = MemoryWorld(nodes * ppn, timeout_s=30)

    def body(rank: int) -> None:
        model = mlp(0)
        opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    layout=_layout(world, rank, ppn), procs_per_node=ppn)
        for step in range(3):
            opt.zero_grad()
            mlp_loss(model, rank, step).backward()
            opt.step()
        opt.close()

    with caplog.at_level(logging.INFO, logger="qcomm"):
        world.run(body)
    records = [r for r in caplog.records if r.name == "qcomm"]
    assert len(records) == 1 and records[0].levelno == level and text in records[0].message
    if nodes > 1:  # the schedule too
        assert "gossip every step, staleness 1, gamma " in records[0].message


def test_layout_line_says_the_schedule() -> None:
    from qcomm.engine.options import CommOptions
    from qcomm.engine.report import topology_line

    topo = Topology(2, rank=0, world_size=8)
    opts = CommOptions(sync_every=16, fragments=4, gamma=0.5, outer_momentum=0.5,
                       wait_free=True, on_peer_loss="continue", procs_per_node=2)
    level, line = topology_line(topo, opts, True, 1000, 0.5)
    assert level == logging.INFO
    assert line.startswith("qcomm: 4 nodes x 2 ranks; gradients averaged inside each node "
                           "(DDP in backward); 1000 parameters gossiped")
    assert line.endswith("gossip every part once every 16 steps in 4 fragments, wait-free, "
                         "going on without lost nodes, gamma 0.5, outer Nesterov momentum 0.5 "
                         "lr 1")


def test_without_logging_configured_the_layout_goes_to_stderr(capsys, monkeypatch) -> None:
    """Python drops INFO records when no handler is configured: the line is printed."""
    from qcomm.engine import report
    from qcomm.engine.options import CommOptions

    monkeypatch.setattr(report.log, "hasHandlers", lambda: False)
    report.log_topology(Topology(1, rank=0, world_size=2), CommOptions(), False, 10, 0.3)
    assert "qcomm: 2 nodes x 1 rank; " in capsys.readouterr().err
    report.log_topology(Topology(1, rank=1, world_size=2), CommOptions(), False, 10, 0.3)
    assert capsys.readouterr().err == ""  # rank 0 only


def test_data_parallel_needs_process_groups_not_the_in_memory_world() -> None:
    # DDP takes a torch.distributed process group: an in-memory topology is refused before any
    # group is created (one thread here: a collective would wait for rank 1).
    world = MemoryWorld(4, timeout_s=5)
    model = mlp(0)
    opt = _adamw(model, _layout(world, 0, 2), intra_bits=None)
    with pytest.raises(TypeError, match=r"needs torch.distributed process groups, not the "
                                        r"groups of MemoryWorld\(4\)"):
        opt.data_parallel(model)
    assert opt.engine.topology is None  # nothing was set up
