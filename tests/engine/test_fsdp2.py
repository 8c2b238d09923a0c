"""FSDP2 inside a node, qcomm between nodes: 2 nodes x 2 ranks over Gloo on CPU.

``fully_shard(model, mesh=mesh["shard"])`` over a ``("replicate", "shard")`` mesh of 2 x 2 makes
each parameter a DTensor sharded over its node's two ranks; the optimizer gossips each rank's
local parts with the same local rank of the other node. Checked here: training agrees with the
same model unsharded under qcomm, ``average_parameters()`` gives every rank the exact mean over
the nodes, and DTensors of any other layout (or with ``intra_bits``, or behind
``data_parallel()``) are refused at construction with ``ShardedParamsError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qcomm.sgd import ASSGD, HierarchicalOptimizer, ShardedParamsError
from tests.worlds import topology

NODES, PPN = 2, 2
WORLD = NODES * PPN
STEPS = 12
# 8-bit messages: the quantization error per round is small enough that cutting the codec's
# blocks differently (see test_sharded_training_matches_the_unsharded_model) barely shows.
OPTIONS: dict[str, Any] = dict(procs_per_node=PPN, bits=8, staleness=1, seed=3)

_MESHES: dict[str, Any] = {}


def _mesh(kind: str = "2d") -> Any:
    """This process's device mesh of ``kind`` ("2d": (replicate=2, shard=2); "1d": the world),
    created once per pooled world (collective: every rank asks in the same body)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind not in _MESHES:
        _MESHES[kind] = (init_device_mesh("cpu", (NODES, PPN),
                                          mesh_dim_names=("replicate", "shard"))
                         if kind == "2d" else init_device_mesh("cpu", (WORLD,)))
    return _MESHES[kind]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Odd row counts: FSDP2's shards are uneven (4 + 3 rows), as they are in real models.
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    # The nodes see different data (an offset per node), so their parameters drift apart
    # between rounds and the gossip has something to do.
    x = torch.randn(16, 8, generator=gen) + rank // PPN
    return x, torch.randint(0, 5, (16,), generator=gen)


def _build(sharded: bool, **options: Any) -> tuple[torch.nn.Module, HierarchicalOptimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if sharded:
        fully_shard(model, mesh=_mesh()["shard"])
    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                layout=topology(PPN), **{**OPTIONS, **options})
    return model, opt


def _train(model: torch.nn.Module, opt: HierarchicalOptimizer, rank: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    """The whole parameters (a collective over the node for sharded ones)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def _run(sharded: bool, rank: int, **options: Any) -> dict[str, Any]:
    """Train, then average: the losses, the whole parameters before and after the average."""
    model, opt = _build(sharded, **options)
    losses = _train(model, opt, rank)
    before = _full(model)
    opt.average_parameters()
    stats = opt.stats(consensus=True)
    out = {"losses": torch.tensor(losses), "before": before, "after": _full(model),
           "stats": stats,
           "local_numel": sum(getattr(p, "to_local", lambda p=p: p)().numel()
                              for p in model.parameters())}
    opt.close()
    return out


def _lockstep_body(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {"plain": _run(False, rank), "plain_other_seed": _run(False, rank, seed=4),
            "sharded": _run(True, rank)}


@pytest.fixture(scope="module")
def lockstep(gloo) -> list[dict[str, dict[str, Any]]]:
    """Three runs of 12 steps on every rank, in one pooled world: unsharded, unsharded with
    another rounding seed, FSDP2-sharded (bounded staleness)."""
    return gloo.run(_lockstep_body, WORLD, timeout_s=120)


def test_sharded_training_matches_the_unsharded_model(lockstep) -> None:
    """The same model, seed, data and options, FSDP2-sharded inside the node or replicated:
    the per-rank losses agree as closely as the gossip's own rounding noise allows.

    Why not bit for bit: the gradients are the same floats (FSDP2's reduce-scatter mean over
    two ranks and qcomm's allreduce mean both give ``(a + b) / 2``, exactly) and AdamW is
    elementwise, but the gossip quantizes blocks of 128 consecutive elements of each rank's
    flat buffer with stochastic rounding. Unsharded, local rank l's buffer is the l-th half of
    all the parameters laid end to end; sharded, it is its rows of each parameter in turn. The
    blocks hold other elements, so their scales and rounding draws differ: to the training,
    that is the same as drawing other rounding noise. The tolerance is therefore measured,
    not guessed: the unsharded run with another rounding seed (about 4e-4 here, on losses
    near 1.6) sets the noise floor, and sharded vs unsharded must stay within 4 times it
    (measured: about 1x). The two nodes' losses differ by about 0.15 (their data differ), a
    hundred times more, so a sharded run that gossiped the wrong parts would not pass.
    """
    floor = max(float((r["plain_other_seed"]["losses"] - r["plain"]["losses"]).abs().max())
                for r in lockstep)
    assert 0 < floor < 2e-3, floor   # 8-bit rounding noise: small, and present
    for rank, r in enumerate(lockstep):
        diff = r["sharded"]["losses"] - r["plain"]["losses"]
        assert diff.abs().max() <= 4 * floor, (rank, diff, floor)
        assert r["sharded"]["stats"]["gossip_rounds"] == r["plain"]["stats"]["gossip_rounds"]
        assert r["sharded"]["stats"]["bytes_sent"]["inter"] > 0
    nodes = lockstep[0]["sharded"]["losses"] - lockstep[PPN]["sharded"]["losses"]
    assert nodes.abs().max() > 100 * floor
    # every rank gossips its own parts only: its share of the parameters, not all of them
    total = sum(p.numel() for p in _model().parameters())
    shares = [r["sharded"]["local_numel"] for r in lockstep[:PPN]]
    assert sum(shares) == total and max(shares) < total


def _check_exact_mean(res: list[dict[str, dict[str, Any]]], run: str) -> None:
    """After ``average_parameters()`` every rank holds the mean over the nodes of the whole
    parameters before it. Bit for bit, with two nodes: the engine sums two float32 values
    (one rounding) and halves (exact), which is the float64 mean rounded to float32."""
    nodes_before = [res[n * PPN][run]["before"] for n in range(NODES)]
    expected = [torch.stack([b[i].double() for b in nodes_before]).mean(0).float()
                for i in range(len(nodes_before[0]))]
    for rank, r in enumerate(res):
        for got, want in zip(r[run]["after"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{run}, rank {rank}")
        assert r[run]["stats"]["consensus_distance"] == 0.0
    # the nodes did differ before the average (the test would be void otherwise)
    assert any(not torch.equal(a, b) for a, b in zip(*nodes_before, strict=True))
    # inside a node the parameters are one model (sharded: one set of parts between them)
    for n in range(NODES):
        for a, b in zip(res[n * PPN][run]["before"], res[n * PPN + 1][run]["before"],
                        strict=True):
            assert torch.equal(a, b)


def test_average_parameters_gives_every_rank_the_exact_mean_of_the_nodes(lockstep) -> None:
    _check_exact_mean(lockstep, "sharded")
    # as the unsharded run does: the sharded path averages as the replicated one
    _check_exact_mean(lockstep, "plain")


def _fragments_body(rank: int, world: int, wait_free: bool) -> dict[str, Any]:
    # Two fragments: a round copies in and out only the fragments it sends and mixes.
    return {"run": _run(True, rank, wait_free=wait_free, sync_every=2, fragments=2)}


def test_fragments_of_the_parts_bounded_staleness(gloo) -> None:
    """``sync_every=2, fragments=2``: each round carries half of each rank's parts; the
    average is still the exact mean of the nodes."""
    res = gloo.run(_fragments_body, WORLD, args=(False,), timeout_s=120)
    _check_exact_mean(res, "run")


def test_wait_free_gossip_of_the_parts_ends_in_one_model(gloo) -> None:
    """``wait_free=True`` (with two fragments) runs through the same code: each rail's
    streams carry its parts. Its average includes what the paired mixing still owed
    (docs/engine.md), so it is not the mean of the parameters as they stood; what holds is
    that every rank ends with the same whole model and the nodes' distance is zero."""
    res = [r["run"] for r in gloo.run(_fragments_body, WORLD, args=(True,), timeout_s=120)]
    for rank, r in enumerate(res):
        for got, want in zip(r["after"], res[0]["after"], strict=True):
            assert torch.equal(got, want), rank
        assert r["stats"]["consensus_distance"] == 0.0
        assert sum(r["stats"]["rounds_received"].values()) > 0
        assert torch.isfinite(r["losses"]).all()
    assert any(not torch.equal(a, b) for a, b in
               zip(res[0]["before"], res[PPN]["before"], strict=True))


def _nan_body(rank: int, world: int) -> dict[str, Any]:
    model, opt = _build(True, on_nonfinite="skip")
    for step in range(4):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step == 2 and rank == 1:
            # one element of one rank's part: its node-mate's parts are all finite
            next(model.parameters()).grad.to_local().view(-1)[0] = float("nan")
        opt.step()
    opt.average_parameters()
    out = {"skipped": opt.stats()["skipped_steps"], "after": _full(model)}
    opt.close()
    return out


def test_a_nan_in_one_ranks_part_is_skipped_by_every_rank(gloo) -> None:
    """Sharded, each rank sees only its part of the node's gradient, so the node votes: a NaN
    in one rank's part skips the step on both ranks of its node (and, with
    ``on_nonfinite="skip"``, on the other node too), and training goes on in step."""
    res = gloo.run(_nan_body, WORLD, timeout_s=60)
    assert [r["skipped"] for r in res] == [1] * WORLD
    for r in res:
        for got, want in zip(r["after"], res[0]["after"], strict=True):
            assert torch.isfinite(got).all() and torch.equal(got, want)


def _refused_body(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    def message(build) -> str:
        try:
            build()
        except ShardedParamsError as e:
            return str(e)
        return "not refused"

    def across_nodes() -> None:
        model = _model()
        fully_shard(model, mesh=_mesh("1d"))
        ASSGD(model.parameters(), lr=0.1, procs_per_node=PPN)

    def hsdp() -> None:
        model = _model()
        fully_shard(model, mesh=_mesh())
        ASSGD(model.parameters(), lr=0.1, procs_per_node=PPN)

    def replicated() -> None:
        weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), _mesh()["shard"],
                                                      [Replicate()]))
        ASSGD([weight], lr=0.1, procs_per_node=PPN)

    def mixed() -> None:
        model = _model()
        fully_shard(model, mesh=_mesh()["shard"])
        ASSGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1,
              procs_per_node=PPN)

    def quantized_mean() -> None:
        model = _model()
        fully_shard(model, mesh=_mesh()["shard"])
        ASSGD(model.parameters(), lr=0.1, procs_per_node=PPN, intra_bits=8)

    def ddp() -> None:
        model = _model()
        fully_shard(model, mesh=_mesh()["shard"])
        ASSGD(model.parameters(), lr=0.1, procs_per_node=PPN).data_parallel(model)

    def in_memory() -> None:
        from qcomm.collectives.memory import MemoryWorld
        from qcomm.collectives.topology import Topology

        model = _model()
        fully_shard(model, mesh=_mesh()["shard"])
        layout = Topology(PPN, rank=rank, world_size=WORLD, world=MemoryWorld(WORLD))
        ASSGD(model.parameters(), lr=0.1, layout=layout)

    return {name: message(build) for name, build in
            [("across_nodes", across_nodes), ("hsdp", hsdp), ("replicated", replicated),
             ("mixed", mixed), ("intra_bits", quantized_mean), ("data_parallel", ddp),
             ("in_memory", in_memory)]}


@pytest.mark.parametrize(("case", "words"), [
    ("across_nodes", ["ranks [0, 1, 2, 3]", "sharded across nodes", "mesh=mesh['shard']"]),
    ("hsdp", ["2-D mesh", "(Replicate(), Shard(dim=0))", "mesh=mesh['shard']"]),
    ("replicated", ["placement Replicate()", "only a plain Shard(dim)"]),
    ("mixed", ["mixed with plain tensors"]),
    ("intra_bits", ["intra_bits=8", "set intra_bits=None"]),
    ("data_parallel", ["data_parallel()", "attach(model)"]),
    ("in_memory", ["need torch.distributed's process groups"]),
])
def test_other_layouts_and_options_are_refused_at_construction(gloo, case, words) -> None:
    """A DTensor sharded across all four ranks (a 1-D mesh over the world), HSDP's 2-D mesh,
    a replicated DTensor, DTensors mixed with a plain parameter, intra_bits, DDP around a
    sharded model, and a layout over the in-memory world: each a ShardedParamsError naming
    what is wrong and what is allowed."""
    messages = _refusals(gloo)
    for rank, m in enumerate(messages):
        for w in words:
            assert w in m[case], (rank, m[case])


_REFUSALS: dict[str, list[dict[str, str]]] = {}


def _refusals(gloo) -> list[dict[str, str]]:
    """The refusals' messages on every rank, collected once for the parametrized test."""
    if "all" not in _REFUSALS:
        _REFUSALS["all"] = gloo.run(_refused_body, WORLD, timeout_s=60)
    return _REFUSALS["all"]
