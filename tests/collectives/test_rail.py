"""The two-stage rail (quantized reduce-scatter + all-gather, :mod:`qcomm.collectives.rail`):
chunk payloads, the bound against the exact mean on in-memory worlds of 2x2, 4x1 and 8x1, the
same bits and bytes in memory as over Gloo, unbiased with stochastic rounding, error feedback
conserved over calls at both stages, non-finite input failing every rank with nothing lost.

Bounds as in tests/collectives/test_hierarchical.py (``codec_mean_bound``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcomm.collectives.buckets import MIB, plan_buckets
from qcomm.collectives.hierarchical import HierarchicalAllreduce
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.rail import chunk_payloads, join_payloads
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import NonFiniteError, QuantSpec, packed_nbytes, quantize
from qcomm.testing.strategies import quant_specs, seeds
from tests.collectives.test_hierarchical import World, codec_mean_bound, expected_bytes
from tests.collectives.test_intra import (
    BLOCK,
    SHAPES,
    SMALL_BUCKET_MB,
    U,
    abs_sum64,
    make_tensors,
    max_excess,
    mean64,
)
from tests.worlds import topology

LAYOUTS = {(2, 2): "2nodes_x2", (4, 1): "4nodes_x1", (8, 1): "8nodes_x1"}  # (nodes, per node)
layouts = pytest.mark.parametrize(("nodes", "ppn"), list(LAYOUTS), ids=list(LAYOUTS.values()))


def _in_memory(nodes: int, ppn: int, body, *args) -> list:
    world = MemoryWorld(nodes * ppn, timeout_s=30)

    def run(rank: int):
        torch.set_num_threads(1)
        topo = Topology(ppn, rank=rank, world_size=world.world_size, world=world)
        return body(rank, topo, *args)

    return world.run(run, timeout_s=120)


# ---------------------------------------------------------------------------------------------
# chunk payloads


@settings(max_examples=60, deadline=None)
@given(spec=quant_specs(block_size=st.sampled_from([32, 64, 128])),
       parts=st.integers(1, 8), blocks=st.integers(1, 3), seed=seeds(), data=st.data())
def test_chunks_are_the_chunk_payloads_and_join_back(spec, parts, blocks, seed, data):
    numel = parts * blocks * spec.block_size
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(3)
    whole = quantize(x, spec, seed=seed).payload
    c = numel // parts
    rows = chunk_payloads(whole, numel, parts, spec,
                          torch.empty(parts, packed_nbytes(c, spec), dtype=torch.uint8))
    joined = join_payloads(rows, numel, spec, torch.empty_like(whole))
    assert torch.equal(joined, whole)
    if spec.rounding == "nearest" or spec.bits == 1:  # deterministic: no seed stream involved
        for j in range(parts):
            alone = quantize(x[j * c:(j + 1) * c], spec).payload
            assert torch.equal(rows[j], alone), j


def test_a_shard_that_is_not_whole_blocks_per_chunk_is_refused():
    spec = QuantSpec(4, 32)
    payload = quantize(torch.randn(96), spec).payload
    with pytest.raises(ValueError, match=r"96 elements.*2 chunks.*32-element blocks"):
        chunk_payloads(payload, 96, 2, spec, torch.empty(2, 40, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# one call against the exact mean, in memory


def _one_call(rank: int, topo: Topology, spec: QuantSpec, call: int, rail: str) -> dict:
    st_ = CommStats()
    ts = make_tensors(rank, call)
    ar = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, stats=st_, seed=3,
                               rail_collective=rail)
    ar.mean_(ts)
    return {"result": ts, "bytes": dict(st_.bytes_sent)}


@layouts
@settings(max_examples=8, deadline=None)
@given(spec=quant_specs(block_size=BLOCK), call=st.integers(0, 10_000))
def test_two_stage_mean_within_its_bound_identical_everywhere(nodes, ppn, spec, call):
    out = _in_memory(nodes, ppn, _one_call, spec, call, "reduce_scatter")
    w = World(nodes * ppn, ppn)
    plan = plan_buckets(make_tensors(0, call), int(SMALL_BUCKET_MB * MIB))
    bound = codec_mean_bound(w, call, spec, plan, "reduce_scatter")
    want = expected_bytes(plan, ppn, nodes, spec, 4, "reduce_scatter")
    for rank, r in enumerate(out):
        assert max_excess(r["result"], mean64(w.everyone(call)), bound) <= 0, rank
        assert all(torch.equal(a, b) for a, b in zip(r["result"], out[0]["result"], strict=True))
        assert r["bytes"] == want, (rank, r["bytes"], want)


def _gloo_call(rank: int, world_size: int, ppn: int, spec: QuantSpec, call: int) -> dict:
    return _one_call(rank, topology(ppn), spec, call, "reduce_scatter")


@pytest.mark.parametrize(("nodes", "ppn"), [(2, 2), (4, 1)], ids=["2nodes_x2", "4nodes_x1"])
@pytest.mark.parametrize("spec", [QuantSpec(4, BLOCK, "stochastic"), QuantSpec(2, BLOCK)],
                         ids=["4bit-stochastic", "2bit-nearest"])
def test_in_memory_and_gloo_give_the_same_bits_and_bytes(gloo, nodes, ppn, spec):
    mem = _in_memory(nodes, ppn, _one_call, spec, 41, "reduce_scatter")
    net = gloo.run(_gloo_call, nodes * ppn, args=(ppn, spec, 41))
    for rank, (a, b) in enumerate(zip(mem, net, strict=True)):
        assert a["bytes"] == b["bytes"], rank
        assert all(torch.equal(x, y) for x, y in zip(a["result"], b["result"], strict=True)), rank


# ---------------------------------------------------------------------------------------------
# stochastic rounding: unbiased through both stages


def _many_calls(rank: int, topo: Topology, spec: QuantSpec, call: int, seeds_: int) -> list:
    """Each seed a fresh allreduce (zero residuals): independent draws of the same mean."""
    out = []
    for seed in range(seeds_):
        ts = make_tensors(rank, call)
        HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, seed=seed,
                              rail_collective="reduce_scatter").mean_(ts)
        out.append(torch.cat([t.reshape(-1).double() for t in ts]))
    return out


def test_two_stage_mean_is_unbiased_with_stochastic_rounding():
    """Hoeffding per element: each result lies within B (the bound) of the exact mean, so the
    mean of T independent draws lies within c B sqrt(2 / T) of its expectation except with
    probability 2 exp(-c**2), Bonferroni over the elements at alpha = 1e-6; the expectation may
    differ from the exact mean by float rounding only (a few u of the values)."""
    nodes, ppn, call, draws = 4, 1, 77, 300
    spec = QuantSpec(4, BLOCK, "stochastic")
    out = _in_memory(nodes, ppn, _many_calls, spec, call, draws)
    w = World(nodes * ppn, ppn)
    plan = plan_buckets(make_tensors(0, call), int(SMALL_BUCKET_MB * MIB))
    bound = torch.cat([b.reshape(-1) for b in codec_mean_bound(w, call, spec, plan,
                                                               "reduce_scatter")])
    exact = torch.cat([e.reshape(-1) for e in mean64(w.everyone(call))])
    scale = torch.cat([a.reshape(-1) for a in abs_sum64(w.everyone(call))])
    mean = torch.stack(out[0]).mean(0)
    m = exact.numel()
    c = math.sqrt(math.log(2 * m / 1e-6))
    allowed = c * bound * math.sqrt(2 / draws) + 64 * U * (scale + bound)
    excess = (mean - exact).abs() - allowed
    assert float(excess.max()) <= 0, int(excess.argmax())
    # ...and the draws do differ: the test would not pass a deterministic codec vacuously.
    assert float((out[0][0] - out[0][1]).abs().max()) > 0


# ---------------------------------------------------------------------------------------------
# error feedback at both stages


def _residuals_over_calls(rank: int, topo: Topology, spec: QuantSpec, calls: int) -> dict:
    ar = HierarchicalAllreduce(topo, spec=spec, bucket_mb=1.0, seed=5,
                               rail_collective="reduce_scatter")
    total = torch.zeros(sum(math.prod(s) for s in SHAPES), dtype=torch.float64)
    for c in range(calls):
        ts = make_tensors(rank, 500 + c)
        ar.mean_(ts, key="ef")
        total += torch.cat([t.reshape(-1).double() for t in ts])
    res = ar.state_dict()["error_feedback"]["residuals"]
    return {"total": total, "node": res["ef/0"].double(), "owner": res["ef/0/owner"].double()}


@pytest.mark.parametrize(("nodes", "ppn"), [(2, 2), (4, 1), (8, 1)],
                         ids=["2nodes_x2", "4nodes_x1", "8nodes_x1"])
@settings(max_examples=6, deadline=None)
@given(spec=quant_specs(block_size=BLOCK))
def test_error_feedback_is_conserved_through_both_stages(nodes, ppn, spec):
    """Over 4 calls (one bucket): sum of results + (1/N) sum_k e_k + f = sum of exact means, e_k
    node k's residual of the shard, f the owners' residuals of its chunks; up to float32
    rounding of values at most a few times the largest input."""
    calls = 4
    out = _in_memory(nodes, ppn, _residuals_over_calls, spec, calls)
    w = World(nodes * ppn, ppn)
    n = sum(math.prod(s) for s in SHAPES)
    exact = sum(torch.cat([e.reshape(-1) for e in mean64(w.everyone(500 + c))])
                for c in range(calls))
    shard = out[0]["node"].numel()
    pad = ppn * shard
    node_res = torch.zeros(nodes, pad, dtype=torch.float64)
    owner_res = torch.zeros(pad, dtype=torch.float64)
    chunk = shard // nodes
    for rank, r in enumerate(out):
        k, lr = divmod(rank, ppn)
        node_res[k, lr * shard:(lr + 1) * shard] = r["node"]
        at = lr * shard + k * chunk  # node k owns chunk k of local rank lr's shard
        owner_res[at:at + chunk] = r["owner"]
    corrected = out[0]["total"] + (node_res.mean(0) + owner_res)[:n]
    biggest = max(float(torch.cat([t.reshape(-1) for t in ts]).abs().max())
                  for c in range(calls) for ts in w.everyone(500 + c))
    tol = calls * (nodes + 16) * 8 * U * biggest
    assert float((corrected - exact).abs().max()) <= tol
    assert float(owner_res.abs().max()) > 0 or spec.bits == 8  # the second stage is exercised


# ---------------------------------------------------------------------------------------------
# non-finite input


def _poisoned(rank: int, topo: Topology) -> dict:
    spec = QuantSpec(4, BLOCK)
    ar = HierarchicalAllreduce(topo, spec=spec, bucket_mb=1.0, rail_collective="reduce_scatter")
    ar.mean_(make_tensors(rank, 1), key="k")
    before = {k: v.clone() for k, v in ar.state_dict()["error_feedback"]["residuals"].items()}
    ts = make_tensors(rank, 2)
    if rank == 1:
        ts[0].view(-1)[3] = float("nan")
    try:
        ar.mean_(ts, key="k")
    except NonFiniteError:
        raised = True
    else:
        raised = False
    after = ar.state_dict()["error_feedback"]["residuals"]
    return {"raised": raised,
            "kept": before.keys() == after.keys()
            and all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.parametrize(("nodes", "ppn"), [(4, 1), (2, 2)], ids=["4nodes_x1", "2nodes_x2"])
def test_a_nan_on_one_rank_fails_every_rank_and_keeps_every_residual(nodes, ppn):
    """Every rank raises (the ranks of the other rail too: they see the NaN shard come back
    through their node's all-gather) and no residual of either stage changed."""
    out = _in_memory(nodes, ppn, _poisoned)
    for rank, r in enumerate(out):
        assert r["kept"], rank
        assert r["raised"], rank
