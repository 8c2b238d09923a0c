"""HierarchicalAllreduce on Gloo: bits=None against dist.all_reduce and the exact mean; bits 8,
4, 2, 1 against the bound the codec guarantees; error feedback over calls; async; bytes per
level; state_dict. Shapes: 2 nodes x 2, 3 x 1, 4 x 1, 1 node x 2.

Bounds (see tests/collectives/test_intra.py for the codec terms; u = 2**-24, A = sum over all
ranks of |x| element-wise, L ranks per node, N nodes):

* bits=None: node mean in float32 is within u * A_k of the exact one (A_k: node k's |x| sum),
  the rail mean of N such values adds u * sum_k |m_k| <= u * A / L, so
  |result - exact| <= u * A * (1/N + 1/L); dist.all_reduce + division is within u * A.
* bits: each node's float32 shard mean v_k (within u * A_k of exact) is quantized; the decoded
  mean is within (1/N) sum_k codec_error(v_k) + float32 accumulation of the exact mean, with
  the codec's scales computed from blocks aligned to the bucket start (shards are
  block-aligned), padding counted as elements (it is part of a shard).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.buckets import MIB, plan_buckets, unpack
from qcomm.collectives.hierarchical import HierarchicalAllreduce, shard_numel
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.multiprocess import run_world
from tests.collectives.test_intra import (
    BLOCK,
    CODEC_CASES,
    SHAPES,
    SMALL_BUCKET_MB,
    U,
    abs_sum64,
    all_gather_flat,
    as64,
    bitwise_same_across,
    check_async,
    codec_error_bound,
    make_tensors,
    max_excess,
    mean64,
    per_block,
)


def _expected_bytes(plan, L: int, N: int, spec: QuantSpec | None, elem: int) -> dict[str, int]:
    intra = inter = 0
    for b in plan:
        s = shard_numel(b.numel, L, N, spec)
        if L > 1:
            intra += 2 * (L - 1) * s * elem  # reduce-scatter + all-gather of s-element shards
        if N > 1:
            inter += ((N - 1) * packed_nbytes(s, spec) if spec is not None
                      else 2 * (N - 1) * (s // N) * elem)
    return {"intra": intra, "inter": inter}


def _hier_body(rank: int, world_size: int, ppn: int) -> dict:
    torch.manual_seed(0)
    topo = Topology(ppn)
    L, N, W = ppn, world_size // ppn, world_size
    cap = int(SMALL_BUCKET_MB * MIB)
    report: dict = {}

    def everyone(call, dtype=torch.float32):
        return [make_tensors(r, call, dtype) for r in range(W)]

    def node_means(call, dtype=torch.float32):
        return [mean64(everyone(call, dtype)[k * L:(k + 1) * L]) for k in range(N)]

    def node_abs(call, dtype=torch.float32):
        return [abs_sum64(everyone(call, dtype)[k * L:(k + 1) * L]) for k in range(N)]

    def fp_bound(call, dtype=torch.float32):
        return [U * a * (1 / N + 1 / L) * 1.01 for a in abs_sum64(everyone(call, dtype))]

    # 1. bits=None, several buckets: exact mean, dist.all_reduce, identical on all ranks, bytes.
    st = CommStats()
    ts = make_tensors(rank, 1)
    ref = [t.clone() for t in ts]
    for t in ref:
        dist.all_reduce(t)
        t.div_(W)
    HierarchicalAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, stats=st).mean_(ts)
    a = abs_sum64(everyone(1))
    report["fp_vs_exact"] = max_excess(ts, mean64(everyone(1)), fp_bound(1))
    report["fp_vs_all_reduce"] = max_excess(
        ts, as64(ref), [b + U * x * 1.01 for b, x in zip(fp_bound(1), a, strict=True)])
    report["fp_identical"] = bitwise_same_across(ts, None, W)
    report["fp_bytes"] = (st.bytes_sent, _expected_bytes(plan_buckets(ts, cap), L, N, None, 4))

    # 2. async: untouched until wait(), then bitwise the blocking result.
    report.update(check_async(HierarchicalAllreduce(topo, bucket_mb=SMALL_BUCKET_MB), rank, ts))

    # 3. codec, one call from zero residuals.
    report["codec"] = {}
    for bits, rounding, bucket_mb, async_op in CODEC_CASES:
        spec = QuantSpec(bits, BLOCK, rounding)
        call = 20 + bits
        st = CommStats()
        tq = make_tensors(rank, call)
        HierarchicalAllreduce(topo, spec=spec, bucket_mb=bucket_mb, stats=st,
                              seed=3).mean_(tq, async_op=async_op).wait()
        plan = plan_buckets(tq, max(1, int(bucket_mb * MIB)))
        if N > 1:
            bound = codec_error_bound(node_means(call), spec, plan, count_padding=True,
                                      slack=[U * x for x in abs_sum64(everyone(call))])
            bound = [b + f for b, f in zip(bound, fp_bound(call), strict=True)]
        else:
            bound = fp_bound(call)  # one node: no codec (nothing crosses a slow link)
        report["codec"][(bits, rounding)] = {
            "excess": max_excess(tq, mean64(everyone(call)), bound),
            "identical": bitwise_same_across(tq, None, W),
            "bytes": (st.bytes_sent, _expected_bytes(plan, L, N, spec, 4)),
        }

    # 4. bfloat16 input, 8 bits: the codec bound plus one rounding to bfloat16 at the end.
    spec = QuantSpec(8, BLOCK)
    tb = make_tensors(rank, 30, torch.bfloat16)
    HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB).mean_(tb)
    plan = plan_buckets(tb, cap)
    exact_b = mean64(everyone(30, torch.bfloat16))
    fb = fp_bound(30, torch.bfloat16)
    if N > 1:
        cb = codec_error_bound(node_means(30, torch.bfloat16), spec, plan, count_padding=True,
                               slack=[U * x for x in abs_sum64(everyone(30, torch.bfloat16))])
        # Without a spec the node means are rounded to bfloat16 before the rail (wire dtype);
        # with one they are quantized from float32: no extra rounding there.
        fb = [c + f for c, f in zip(cb, fb, strict=True)]
    report["bf16"] = max_excess(
        tb, exact_b, [f + 2.0**-8 * (e.abs() + f) for f, e in zip(fb, exact_b, strict=True)])

    # 5. error feedback over several calls (2 bits): sum of results + mean_k residual_k equals
    #    the sum of exact means, and every residual stays within max_t block absmax / (2 L_q - 1).
    spec = QuantSpec(2, BLOCK)
    ar = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB)
    calls = 5
    plan = plan_buckets(make_tensors(rank, 0), cap)
    run_got = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    run_exact = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    tol = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    m_bound = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(N)]
    for c in range(calls):
        x = make_tensors(rank, 200 + c)
        ar.mean_(x, key="ef")
        for i, (g, e) in enumerate(zip(x, mean64(everyone(200 + c)), strict=True)):
            run_got[i] += g.double()
            run_exact[i] += e
        means, absn = node_means(200 + c), node_abs(200 + c)
        for k in range(N):
            am = per_block([m + U * n for m, n in zip(means[k], absn[k], strict=True)], plan,
                           BLOCK, "absmax", True)
            m_bound[k] = [torch.maximum(p, q) for p, q in zip(m_bound[k], am, strict=True)]
        a = abs_sum64(everyone(200 + c))
        for i in range(len(SHAPES)):
            # Per call: node-mean rounding, decode/accumulate rounding with |v|, scale <= 2M,
            # and the running sum's own rounding.
            tol[i] += U * a[i] * (1 / N + 1 / L) * 1.01 + U * run_got[i].abs() + (
                (N + 3) * U * 4 * sum(mb[i] for mb in m_bound) / N if N > 1 else 0)
    residuals = _node_residuals(ar, plan, topo) if N > 1 else [
        [torch.zeros(s) for s in SHAPES]]
    corrected = [run_got[i] + sum(r[i].double() for r in residuals) / N
                 for i in range(len(SHAPES))]
    report["ef_identity"] = max_excess(corrected, run_exact, tol)
    if N > 1:
        report["ef_residual_bound"] = max(
            max_excess(residuals[k], [torch.zeros_like(t) for t in m_bound[k]],
                       [t * (1 + 1e-5) for t in m_bound[k]]) for k in range(N))

    # 6. state_dict: a fresh instance loaded with the state continues bit-identically
    #    (stochastic rounding, so the call count that seeds it matters too).
    spec = QuantSpec(4, BLOCK, "stochastic")
    a1 = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, seed=9)
    for c in range(2):
        a1.mean_(make_tensors(rank, 300 + c))
    a2 = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, seed=9)
    a2.load_state_dict(a1.state_dict())
    y1, y2 = make_tensors(rank, 302), make_tensors(rank, 302)
    a1.mean_(y1)
    a2.mean_(y2)
    report["state_dict"] = all(torch.equal(p, q) for p, q in zip(y1, y2, strict=True))

    # 7. empty tensors: nothing sent.
    st = CommStats()
    HierarchicalAllreduce(topo, spec=QuantSpec(4, 32), stats=st).mean_([torch.empty(0)])
    HierarchicalAllreduce(topo, stats=st).mean_([])
    report["empty_bytes"] = st.bytes_sent

    # 8. bad input, before any communication.
    errors = {}
    for name, fn, exc in [
        ("spec", lambda: HierarchicalAllreduce(topo, spec="4bit"), TypeError),
        ("bucket_mb", lambda: HierarchicalAllreduce(topo, bucket_mb=0.0), ValueError),
        ("dtype", lambda: HierarchicalAllreduce(topo).mean_([torch.zeros(2, dtype=torch.int64)]),
         TypeError),
        ("contiguous", lambda: HierarchicalAllreduce(topo).mean_([torch.zeros(3, 2).t()]),
         ValueError),
        ("wrong_world", lambda: HierarchicalAllreduce(
            Topology(1, rank=0, world_size=W + 1)).mean_([torch.zeros(2)]), RuntimeError),
        ("state", lambda: HierarchicalAllreduce(topo).load_state_dict({"calls": 1}), ValueError),
    ]:
        try:
            fn()
            errors[name] = None
        except exc as e:
            errors[name] = str(e)
    report["errors"] = errors
    return report


def _node_residuals(ar: HierarchicalAllreduce, plan, topo: Topology) -> list[list[torch.Tensor]]:
    """Node k's residual as tensors shaped like SHAPES: the concatenation, by local rank, of the
    shard residuals its ranks hold (gathered over the world)."""
    L, N, W = topo.procs_per_node, topo.num_nodes, topo.world_size
    state = ar.state_dict()["error_feedback"]["residuals"]
    out = [[torch.zeros(s) for s in SHAPES] for _ in range(N)]
    for i, b in enumerate(plan):
        mine = state[f"ef/{i}"]
        rows = torch.empty(W * mine.numel())
        all_gather_flat(rows, mine)
        rows = rows.view(N, L * mine.numel())
        for k in range(N):
            unpack(b, rows[k], out[k])
    return out


SHAPE_IDS = {(4, 2): "2nodes_x2", (3, 1): "3nodes_x1", (4, 1): "4nodes_x1", (2, 2): "1node_x2"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world", "ppn"), list(SHAPE_IDS), ids=list(SHAPE_IDS.values()))
def test_hierarchical_allreduce(world, ppn):
    reports = run_world(_hier_body, world, args=(ppn,), timeout_s=120)
    nodes = world // ppn
    for rank, r in enumerate(reports):
        where = f"rank {rank}"
        assert r["fp_vs_exact"] <= 0, (where, r["fp_vs_exact"])
        assert r["fp_vs_all_reduce"] <= 0, (where, r["fp_vs_all_reduce"])
        assert r["fp_identical"], where
        got, want = r["fp_bytes"]
        assert got == want, (where, got, want)
        assert r["async_untouched"] and r["async_equal_blocking"] and r["async_completed"], where
        for cfg, c in r["codec"].items():
            assert c["excess"] <= 0, (where, cfg, c)
            assert c["identical"], (where, cfg)
            assert c["bytes"][0] == c["bytes"][1], (where, cfg, c["bytes"])
        assert r["bf16"] <= 0, (where, r["bf16"])
        assert r["ef_identity"] <= 0, (where, r["ef_identity"])
        if nodes > 1:
            assert r["ef_residual_bound"] <= 0, (where, r["ef_residual_bound"])
        assert r["state_dict"], where
        assert r["empty_bytes"] == {"intra": 0, "inter": 0}, where
        e = r["errors"]
        assert "spec" in e["spec"] and "bucket_mb" in e["bucket_mb"]
        assert "int64" in e["dtype"] and "contiguous" in e["contiguous"]
        assert f"world_size {world + 1}" in e["wrong_world"]
        assert "state" in e["state"]


def test_single_process_is_identity_without_a_process_group():
    topo = Topology(1, rank=0, world_size=1)
    st = CommStats()
    ts = make_tensors(0, 1)
    before = [t.clone() for t in ts]
    h = HierarchicalAllreduce(topo, spec=QuantSpec(2, 32), stats=st).mean_(ts, async_op=True)
    assert h.is_completed()
    h.wait()
    assert all(torch.equal(a, b) for a, b in zip(ts, before, strict=True))
    assert st.bytes_sent == {"intra": 0, "inter": 0}


@pytest.mark.parametrize(("numel", "L", "N", "bits", "want"), [
    (261, 2, 2, 4, 160), (261, 2, 2, None, 132), (261, 1, 3, None, 261), (261, 1, 3, 4, 288),
    (261, 2, 1, 4, 131), (0, 2, 2, 4, 0), (1, 4, 4, 8, 32),
])
def test_shard_numel_is_equal_and_aligned(numel, L, N, bits, want):
    spec = QuantSpec(bits, 32) if bits else None
    s = shard_numel(numel, L, N, spec)
    assert s == want and L * s >= numel
    if N > 1:
        assert s % (32 if spec else N) == 0
