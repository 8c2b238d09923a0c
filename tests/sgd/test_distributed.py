"""ASSGD and HierarchicalOptimizer with several ranks: one node equals DDP, 2x2 convergence to a
known optimum, checkpoint resume bit for bit, non-finite gradients, world-size mismatch.

What needs processes (DDP, per-rank checkpoint files named by torch.distributed's rank) runs in
the session-wide Gloo worlds of the ``gloo`` fixture; what tests the engine's arithmetic over
hundreds of steps (convergence) runs with ranks as threads (``MemoryWorld``), which sends the
same bytes as Gloo (``tests/engine/test_engine_memory.py``) in a fraction of the time."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.gossip.integrity import SEAL_NBYTES
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.sgd import (
    ASSGD,
    SLOW_LINK,
    HierarchicalOptimizer,
    NonFiniteGradientError,
    load_checkpoint,
    save_checkpoint,
)
from tests.engine.problems import mlp


def _in_memory(world_size: int, body, *args) -> list:
    """``body(rank, world, *args)`` on ``world_size`` threads (one torch thread each, as the
    spawned ranks have), results by rank."""
    world = MemoryWorld(world_size, timeout_s=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return world.run(lambda rank: body(rank, world, *args), timeout_s=240)
    finally:
        torch.set_num_threads(threads)


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


# ---------------------------------------------------------------------------------------------
# one node (2 ranks): ASSGD is synchronous data-parallel SGD, i.e. DDP + torch.optim.SGD


def _one_node_body(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    ddp = DDP(_mlp(0))
    ref = torch.optim.SGD(ddp.parameters(), **kw)
    ours = _mlp(0)
    opt = ASSGD(ours.parameters(), **kw, procs_per_node=world)
    for step in range(15):
        for model, o in ((ddp, ref), (ours, opt)):
            o.zero_grad()
            _loss(model, rank, step).backward()
            o.step()
    diffs = [(a - b).abs().max().item()
             for a, b in zip(ddp.module.parameters(), ours.parameters(), strict=True)]
    params = [p.detach().clone().numpy() for p in ours.parameters()]
    st = opt.stats()
    opt.close()
    return {"diffs": diffs, "params": params, "bytes": st["bytes_sent"]}


def test_one_node_equals_ddp(gloo) -> None:
    res = gloo.run(_one_node_body, 2)
    for r in res:
        # (a + b) / 2 (ours) and a / 2 + b / 2 (DDP) are the same float for 2 ranks.
        assert max(r["diffs"]) == 0.0, r["diffs"]
        assert r["bytes"]["inter"] == 0 and r["bytes"]["intra"] > 0
    assert all((a == b).all() for a, b in zip(res[0]["params"], res[1]["params"], strict=True))


def _nonfinite_one_node_body(rank: int, world: MemoryWorld) -> dict:
    """A non-finite gradient on rank 1 only: every rank of the node raises, nothing changes."""
    model = mlp(0)  # ranks are threads: weights from a private generator, not torch's global
    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, procs_per_node=2,
                layout=Topology(2, rank=rank, world_size=2, world=world))
    for step in range(3):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, rank, 99).backward()
    if rank == 1:
        next(iter(model.parameters())).grad[0, 0] = float("inf")
    raised = False
    try:
        opt.step()
    except NonFiniteGradientError:
        raised = True
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"raised": raised, "unchanged": unchanged}


def test_nonfinite_gradient_on_one_rank_raises_on_every_rank_of_the_node() -> None:
    for r in _in_memory(2, _nonfinite_one_node_body):
        assert r == {"raised": True, "unchanged": True}


def _nan_update_body(rank: int, world: int) -> list[str]:
    """2 nodes of 1 in lockstep; the wrapped SGD's third step writes NaN into a parameter on
    every rank (as AdamW's step does on float16 parameters, whose eps underflows to 0)."""
    from qcomm.compress import NonFiniteError

    model = _mlp(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = HierarchicalOptimizer(inner, bits=4, procs_per_node=1, timeout_s=30)
    seen = []
    for step in range(3):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if step == 2:
            inner.register_step_post_hook(lambda o, a, k: model[0].weight.data.fill_(float("nan")))
        try:
            opt.step()
            seen.append("stepped")
        except NonFiniteError as e:
            seen.append(f"{e.argument}: {e}")
    opt.close()
    return seen


def test_parameters_made_nonfinite_by_the_local_update_are_named(gloo) -> None:
    for seen in gloo.run(_nan_update_body, 2, timeout_s=120):
        assert seen[:2] == ["stepped", "stepped"], seen
        assert seen[2].startswith("x: the communicated parameters hold NaN or Inf after this "
                                  "step's local update"), seen


def _payload_overflow_body(rank: int, world: MemoryWorld) -> str:
    """2 nodes of 1 in lockstep, finite parameters; the second round's gossip refuses a
    neighbour's payloads (AccumulateOverflowError, argument "payloads") on both ranks."""
    from qcomm.compress import AccumulateOverflowError

    model = mlp(0)
    opt = ASSGD(model.parameters(), lr=0.1, bits=4, seed=1,
                layout=Topology(1, rank=rank, world_size=2, world=world))
    seen = ""
    for step in range(2):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if step == 1:
            def overflow(shard: torch.Tensor) -> None:
                raise AccumulateOverflowError("payloads would overflow out", "payloads", [0])
            opt.engine._runtime.node.gossip.end_step = overflow
        try:
            opt.step()
        except AccumulateOverflowError as e:
            seen = f"{type(e).__name__}: {e}"
    opt.close()
    return seen


def test_a_neighbours_payload_error_is_not_named_as_the_parameters() -> None:
    for seen in _in_memory(2, _payload_overflow_body):
        assert seen == "AccumulateOverflowError: payloads would overflow out", seen


# ---------------------------------------------------------------------------------------------
# 2 nodes x 2 ranks: least squares whose nodes disagree; the optimum is known in closed form


DIM, ROWS = 24, 12


def _problem(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    a = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    # Different targets per rank (and per node): no rank's own optimum is the global one.
    b = a @ torch.ones(DIM, dtype=torch.float64) + (rank + 1) * torch.randn(
        ROWS, generator=g, dtype=torch.float64)
    return a, b


def _optimum(world: int) -> torch.Tensor:
    ata = sum(_problem(r)[0].T @ _problem(r)[0] for r in range(world))
    atb = sum(_problem(r)[0].T @ _problem(r)[1] for r in range(world))
    return torch.linalg.solve(ata, atb)


def _node_optimum(node: int, ppn: int) -> torch.Tensor:
    ranks = range(node * ppn, (node + 1) * ppn)
    ata = sum(_problem(r)[0].T @ _problem(r)[0] for r in ranks)
    atb = sum(_problem(r)[0].T @ _problem(r)[1] for r in ranks)
    return torch.linalg.solve(ata, atb)


def _least_squares(opt: torch.optim.Optimizer, a: torch.Tensor, b: torch.Tensor,
                   w: torch.Tensor, steps: int) -> dict:
    """``steps`` steps on 0.5 ||a w - b||^2 under a cosine schedule; the stats with the
    consensus distance."""
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * ((a @ w - b) ** 2).sum()).backward()
        opt.step()
        sched.step()
    return opt.stats(consensus=True)


def _convergence_body(rank: int, world: MemoryWorld, steps: int) -> dict:
    a, b = (t.float() for t in _problem(rank))
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = ASSGD([w], lr=0.02, momentum=0.5, bits=4, procs_per_node=2, staleness=1, seed=3,
                layout=Topology(2, rank=rank, world_size=4, world=world))
    st = _least_squares(opt, a, b, w, steps)
    own = w.detach().clone()
    opt.average_parameters()
    opt.close()
    return {"own": own, "avg": w.detach().clone(), "stats": st}


def test_two_by_two_converges_to_the_known_optimum() -> None:
    steps = 400
    res = _in_memory(4, _convergence_body, steps)
    opt = _optimum(4).float()
    scale = opt.norm().item()
    node_gap = (_node_optimum(0, 2).float() - opt).norm().item() / scale
    for r in res:
        err = (r["avg"] - opt).norm().item() / scale
        own_err = (r["own"] - opt).norm().item() / scale
        # Each node alone would stop at its own optimum, node_gap away: gossip closes 100x of it.
        assert node_gap > 0.05, node_gap
        assert err < node_gap / 100, (err, node_gap)
        assert own_err < node_gap / 30, (own_err, node_gap)
        st = r["stats"]
        assert st["consensus_distance"] < 1e-3 * scale
        assert st["steps"] == st["gossip_rounds"] == steps and st["staleness"] == 1
        # Ring of 2 nodes: one neighbour; the shard of 24 floats pads to one 128-float block.
        per_round = packed_nbytes(128, QuantSpec(4, 128, "stochastic")) + SEAL_NBYTES
        assert st["bytes_sent"]["inter"] == steps * per_round
    # average_parameters: every rank holds the same bytes.
    assert all(torch.equal(res[0]["avg"], r["avg"]) for r in res)


# ---------------------------------------------------------------------------------------------
# 2 x 2: checkpoint at step k and resume == uninterrupted; skip a NaN step == never taking it


def _train(model: torch.nn.Module, opt: ASSGD, rank: int, steps: range,
           nan_at: int | None = None, omit: int | None = None) -> None:
    for step in steps:
        if step == omit:
            continue
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if step == nan_at and rank == 1:
            next(iter(model.parameters())).grad[1, 1] = float("nan")
        opt.step()


_KW = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, bits=4, procs_per_node=2,
           staleness=2, seed=11)


def _resume_body(rank: int, world: int, directory: str) -> dict:
    full = _mlp(0)
    opt = ASSGD(full.parameters(), **_KW)
    _train(full, opt, rank, range(0, 7))
    dist.barrier()
    save_checkpoint(directory, opt, full, extra={"step": 7})
    _train(full, opt, rank, range(7, 14))
    opt.close()

    resumed = _mlp(123)
    opt2 = ASSGD(resumed.parameters(), **_KW)
    extra = load_checkpoint(directory, opt2, resumed)
    _train(resumed, opt2, rank, range(7, 14))
    opt2.close()
    return {
        "resumed_equal": all(torch.equal(a, b) for a, b in
                             zip(full.parameters(), resumed.parameters(), strict=True)),
        "momentum_equal": all(
            torch.equal(opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"])
            for a, b in zip(full.parameters(), resumed.parameters(), strict=True)),
        "extra": extra,
        "moved": not torch.equal(next(iter(full.parameters())),
                                 next(iter(_mlp(0).parameters())))}


@pytest.fixture(scope="module")
def checkpointed(gloo, tmp_path_factory) -> tuple[list[dict], object]:
    """A 2 x 2 run checkpointed at step 7 and resumed from its files: (reports, directory)."""
    directory = tmp_path_factory.mktemp("checkpoint")
    return gloo.run(_resume_body, 4, args=(str(directory),)), directory


def test_checkpoint_resume_is_bit_exact(checkpointed) -> None:
    for r in checkpointed[0]:
        assert r["moved"]
        assert r["resumed_equal"] and r["momentum_equal"] and r["extra"] == {"step": 7}


def test_checkpoint_writes_one_file_and_one_record_per_rank(checkpointed) -> None:
    directory = checkpointed[1]
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        f"rank{r:05d}.{ext}" for r in range(4) for ext in ("json", "pt"))
    for r in range(4):
        record = json.loads((directory / f"rank{r:05d}.json").read_text())
        assert record["rank"] == r and record["world_size"] == 4
        assert record["procs_per_node"] == 2 and record["steps"] == 7
        assert record["bytes"] == (directory / f"rank{r:05d}.pt").stat().st_size


def test_loading_into_another_world_size_raises_or_reinits(checkpointed) -> None:
    # This process has no process group: world size 1 against the checkpoint's 4.
    directory = checkpointed[1]
    model = _mlp(5)
    opt = ASSGD(model.parameters(), **{k: v for k, v in _KW.items() if k != "bits"})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"world size 4 .*world size 1"):
        load_checkpoint(directory, opt, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state
    # reinit: momentum and parameters of saved rank 0 kept, the gossip state restarts (warned).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(directory, opt, model, on_world_size_change="reinit")
    assert any("re-initialized" in str(w.message) for w in caught)
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    _loss(model, 0, 0).backward()
    opt.step()  # trains on, single process


def _skip_body(rank: int, world: MemoryWorld, nan_at: int | None, omit: int | None) -> dict:
    model = mlp(0)  # ranks are threads: weights from a private generator, not torch's global
    opt = ASSGD(model.parameters(), **_KW, on_nonfinite="skip",
                layout=Topology(2, rank=rank, world_size=4, world=world))
    _train(model, opt, rank, range(10), nan_at=nan_at, omit=omit)
    st = opt.stats()
    opt.close()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "skipped": st["skipped_steps"], "rounds": st["gossip_rounds"]}


def test_skipping_a_nan_step_equals_never_taking_it() -> None:
    """on_nonfinite="skip": a NaN on rank 1 (node 0) skips the step on all 4 ranks."""
    skipped = _in_memory(4, _skip_body, 4, None)
    omitted = _in_memory(4, _skip_body, None, 4)
    for a, b in zip(skipped, omitted, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert a["skipped"] == 1 and b["skipped"] == 0 and a["rounds"] == b["rounds"] == 9


def _scaler_body(rank: int, world: MemoryWorld, inf_at: int | None, omit: int | None,
                 wait_free: bool) -> dict:
    """The guide's recipe for torch's GradScaler with several nodes: ``on_nonfinite="skip"``
    and ``sync_gradients()`` before ``scaler.unscale_``. At ``inf_at`` rank 1's loss is Inf."""
    model = mlp(0)
    comm = dict(SLOW_LINK) if wait_free else dict(bits=4, staleness=1)
    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, on_nonfinite="skip", seed=1,
                layout=Topology(2, rank=rank, world_size=4, world=world), **comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    votes, scales = [], []
    for step in range(10):
        opt.zero_grad()
        if step == omit:
            continue
        loss = _loss(model, rank, step)
        if step == inf_at and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        votes.append(opt.sync_gradients())
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    st = opt.stats()
    opt.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "votes": votes,
            "scales": scales, "skipped": st["skipped_steps"], "steps": st["steps"]}


@pytest.mark.parametrize("wait_free", [False, True], ids=["lockstep", "wait_free"])
def test_the_guides_gradscaler_recipe_skips_an_overflowing_step(wait_free: bool) -> None:
    """2 nodes of 2, an Inf in rank 1's loss at step 4: node 0 skips the step as if it had
    never been taken and its scaler halves its scale; in lockstep node 1 skips it too (the
    nodes vote; every rank bit for bit as if no rank had taken it) and keeps its scale,
    wait-free it takes the step (the nodes decide alone)."""
    skipped = _in_memory(4, _scaler_body, 4, None, wait_free)
    omitted = _in_memory(4, _scaler_body, None, 4, wait_free)
    for rank, (a, b) in enumerate(zip(skipped, omitted, strict=True)):
        overflowed = rank < 2
        skips = overflowed or not wait_free
        assert a["votes"] == [step != 4 or not skips for step in range(10)], rank
        assert a["skipped"] == int(skips) and b["skipped"] == 0, rank
        assert a["steps"] == (9 if skips else 10) and b["steps"] == 9, rank
        assert a["scales"] == [256.0] * 4 + [128.0 if overflowed else 256.0] * 6, rank
        if not wait_free:
            assert all(torch.equal(x, y)
                       for x, y in zip(a["params"], b["params"], strict=True)), rank


# ---------------------------------------------------------------------------------------------
# AdamW through HierarchicalOptimizer: 2 x 2 and 4 x 1 reach the closed-form optimum that no
# node reaches alone; frozen and never-used parameters stay bit-identical.


def _adamw_body(rank: int, world: MemoryWorld, ppn: int, steps: int, lr: float) -> dict:
    from qcomm.sgd import HierarchicalOptimizer
    from tests.engine.problems import DIM, realizable_problem

    a, b, _ = (t.float() for t in realizable_problem(rank))
    w = torch.nn.Parameter(torch.zeros(DIM))
    frozen = torch.nn.Parameter(torch.arange(5.0), requires_grad=False)
    unused = torch.nn.Parameter(torch.full((7,), 0.5))
    inner = torch.optim.AdamW([w, frozen, unused], lr=lr, weight_decay=0.0)
    opt = HierarchicalOptimizer(inner, bits=4, staleness=1, seed=3, procs_per_node=ppn,
                                layout=Topology(ppn, rank=rank, world_size=4, world=world))
    st = _least_squares(opt, a, b, w, steps)
    opt.average_parameters()
    opt.close()
    return {"avg": w.detach().clone(), "stats": st,
            "frozen": torch.equal(frozen, torch.arange(5.0)),
            "unused": torch.equal(unused, torch.full((7,), 0.5))}


@pytest.mark.parametrize(("ppn", "steps", "lr"), [(2, 400, 0.2), (1, 800, 0.5)],
                         ids=["2x2", "4x1"])
def test_adamw_reaches_the_optimum_no_node_reaches_alone(ppn: int, steps: int, lr: float
                                                         ) -> None:
    from tests.engine.problems import node_alone_gap, realizable_problem

    res = _in_memory(4, _adamw_body, ppn, steps, lr)
    w_star = realizable_problem(0)[2].float()
    gap = node_alone_gap(range(ppn))  # node 0 alone: its projection of the optimum
    assert gap > 0.5, gap
    for r in res:
        err = float((r["avg"] - w_star).norm() / w_star.norm())
        assert err < gap / 100, (err, gap)
        assert r["stats"]["consensus_distance"] < 1e-3 * float(w_star.norm())
        assert r["stats"]["gossip_rounds"] == steps
        assert r["frozen"] and r["unused"]
    assert all(torch.equal(res[0]["avg"], r["avg"]) for r in res)


def _ddp_intra_body(rank: int, world: int, use_ddp: bool) -> list:
    from qcomm.sgd import HierarchicalOptimizer
    from tests.engine.problems import mlp, mlp_loss

    model = mlp(0)
    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                procs_per_node=2, seed=1)
    net = opt.data_parallel(model) if use_ddp else model
    for step in range(10):
        opt.zero_grad()
        mlp_loss(net, rank, step).backward()
        opt.step()
    st = opt.stats()
    opt.close()
    return [p.detach().clone().numpy() for p in model.parameters()] + [st["bytes_sent"]]


def test_node_mean_by_ddp_equals_the_own_mean(gloo) -> None:
    """With 2 ranks per node DDP's a/2 + b/2 and qcomm's (a + b)/2 are the same floats."""
    own = gloo.run(_ddp_intra_body, 4, args=(False,))
    ddp = gloo.run(_ddp_intra_body, 4, args=(True,))
    for a, b in zip(own, ddp, strict=True):
        assert all((x == y).all() for x, y in zip(a[:-1], b[:-1], strict=True))
        assert a[-1]["inter"] == b[-1]["inter"] > 0
        assert b[-1]["intra"] < a[-1]["intra"]  # DDP's bytes are not counted by qcomm
