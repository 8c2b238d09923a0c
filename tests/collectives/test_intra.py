"""IntraNodeAllreduce on Gloo: full precision against dist.all_reduce and the exact mean, the
codec against the bound it guarantees, error feedback over calls, async, bytes, bad input.

Bounds used below (u = 2**-24, float32 unit roundoff; A = sum over contributions of |x|,
element-wise; K = number of contributions averaged):

* float32 mean of K values, any summation order, then one division: |fl - exact| <= u * A
  (sum error (K-1) u A, divided by K, plus u |mean| for the division).
* codec, nearest rounding, bits >= 2: |D(Q(v)) - v| <= scale / 2 per element, scale = block
  absmax / (2**(bits-1) - 1) (the wire format guarantees |v / scale| <= L, no clamping);
  stochastic rounding: <= scale; 1 bit: D = sign(v) * s with s = block mean |v|, so
  |D - v| = ||v| - s| <= max(s, absmax - s).
  dequant_accumulate adds K terms w * D_k in float32: rounding <= (K + 3) u sum_k |D_k| / K.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives.buckets import MIB, Bucket, pack, plan_buckets, unpack
from qcomm.collectives.errors import PeerTimeoutError
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.multiprocess import run_world

U = 2.0**-24

# torch 2.13 warns on all_gather_into_tensor; all_gather_single is the same call.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Odd sizes: not multiples of anything, an empty tensor, a single element, mixed ranks.
SHAPES = [(7, 3), (50,), (0,), (1,), (5, 4, 3), (129,)]
SMALL_BUCKET_MB = 400 / MIB  # 100 float32 elements: several buckets, tensors spanning two
BLOCK = 32


# (bits, rounding, bucket_mb, async_op): every width, one and several buckets, async and not.
CODEC_CASES = [
    (8, "nearest", 1.0, False), (4, "nearest", SMALL_BUCKET_MB, True),
    (2, "nearest", 1.0, True), (1, "nearest", SMALL_BUCKET_MB, False),
    (4, "stochastic", SMALL_BUCKET_MB, False),
]


def check_async(engine: object, rank: int, blocking: list[torch.Tensor]) -> dict[str, bool]:
    """``engine.mean_(async_op=True)`` on call-1 tensors: untouched until ``wait()``, then
    bitwise equal to ``blocking`` (what the blocking call gave), and completed."""
    ts = make_tensors(rank, 1)
    before = [t.clone() for t in ts]
    h = engine.mean_(ts, async_op=True)
    untouched = all(torch.equal(x, y) for x, y in zip(ts, before, strict=True))
    h.wait(timeout_s=60)
    return {
        "async_untouched": untouched,
        "async_equal_blocking": all(torch.equal(x, y) for x, y in zip(ts, blocking, strict=True)),
        "async_completed": h.is_completed(),
    }


def make_tensors(rank: int, call: int, dtype: torch.dtype = torch.float32,
                 shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    """Rank- and call-dependent data every process can recompute for every rank."""
    g = torch.Generator().manual_seed(7919 * call + rank)
    return [(torch.randn(s, generator=g) * (1.0 + rank)).to(dtype) for s in shapes]


def as64(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to(torch.float64) for t in ts]


def mean64(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    k = len(lists)
    return [sum(as64(parts)) / k for parts in zip(*lists, strict=True)] if k else []


def abs_sum64(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(t.abs() for t in as64(parts)) for parts in zip(*lists, strict=True)]


def per_block(values: list[torch.Tensor], plan: list[Bucket], block: int, stat: str,
              count_padding: bool) -> list[torch.Tensor]:
    """For each element, a statistic of its codec block (blocks start at each bucket's start).

    stat: "absmax" or "absmean" (mean |v| over the block's counted elements; with
    count_padding the zero padding of a partial last block counts, as in a padded shard).
    """
    out = [torch.zeros_like(v) for v in values]
    for b in plan:
        nb = -(-b.numel // block)
        buf = torch.zeros(nb * block, dtype=torch.float64)
        pack(b, values, buf)
        blocks = buf.view(nb, block).abs()
        if stat == "absmax":
            s = blocks.amax(dim=1)
        else:
            counts = torch.full((nb,), float(block), dtype=torch.float64)
            if not count_padding:
                counts[-1] = b.numel - (nb - 1) * block
            s = blocks.sum(dim=1) / counts
        unpack(b, s.repeat_interleave(block), out)
    return out


def codec_error_bound(contribs: list[list[torch.Tensor]], spec: QuantSpec, plan: list[Bucket],
                      count_padding: bool, slack: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-element bound on |mean_k D(Q(v_k)) - mean_k v_k| for one call from a zero residual.

    contribs: the K quantized vectors v_k (float64, exact). slack: per element, an upper bound
    on how far the float32 v_k the codec saw may be from the exact ones (it raises the scales).
    """
    k = len(contribs)
    bound = [torch.zeros_like(t) for t in contribs[0]]
    for v in contribs:
        amax = per_block(v, plan, spec.block_size, "absmax", count_padding)
        amax_slack = per_block(slack, plan, spec.block_size, "absmax", count_padding)
        for i, (vi, a, sl) in enumerate(zip(v, amax, amax_slack, strict=True)):
            a = (a + sl) * (1 + 4 * U)
            if spec.bits == 1:
                mean_abs = per_block(v, plan, spec.block_size, "absmean", count_padding)[i]
                err = torch.maximum(mean_abs, a - mean_abs) + 2 * sl
                decoded = mean_abs + sl
            else:
                scale = a / spec.max_level
                err = scale / 2 if spec.rounding == "nearest" else scale
                decoded = vi.abs() + err
            bound[i] += err / k + (k + 3) * U * decoded / k
    return bound


def max_excess(got: list[torch.Tensor], want: list[torch.Tensor],
               bound: list[torch.Tensor]) -> float:
    """max over elements of |got - want| - bound (<= 0 means the bound holds everywhere)."""
    worst = -math.inf
    for g, w, b in zip(got, want, bound, strict=True):
        if g.numel():
            worst = max(worst, float(((g.to(torch.float64) - w).abs() - b).max()))
    return worst


def gather_lists(ts: list[torch.Tensor], group, size: int) -> list[list[torch.Tensor]]:
    """Every group member's copy of ``ts`` (float32 flat all-gather), by group rank."""
    flat = torch.cat([t.reshape(-1).float() for t in ts]) if ts else torch.empty(0)
    out = torch.empty(size * flat.numel())
    all_gather_flat(out, flat, group=group)
    rows = out.view(size, -1)
    res = []
    for r in range(size):
        off, parts = 0, []
        for t in ts:
            parts.append(rows[r, off:off + t.numel()].view(t.shape).clone())
            off += t.numel()
        res.append(parts)
    return res


def bitwise_same_across(ts: list[torch.Tensor], group, size: int) -> bool:
    copies = gather_lists(ts, group, size)
    return all(torch.equal(a, b) for c in copies for a, b in zip(c, copies[0], strict=True))


# ---------------------------------------------------------------------------------------------
# the world body: many checks, one spawn


def _intra_body(rank: int, world_size: int, ppn: int) -> dict:
    torch.manual_seed(0)
    topo = Topology(ppn)
    L = ppn
    node_ranks = topo.node_ranks
    group = topo.intra_group
    cap = int(SMALL_BUCKET_MB * MIB)
    report: dict = {}

    def node_inputs(call, dtype=torch.float32):
        return [make_tensors(r, call, dtype) for r in node_ranks]

    # 1. full precision, blocking, several buckets: vs the exact mean and vs dist.all_reduce.
    stats = CommStats()
    ar = IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, stats=stats)
    ts = make_tensors(rank, 1)
    ref = [t.clone() for t in ts]
    for t in ref:
        dist.all_reduce(t, group=group)
        t.div_(L)
    handle = ar.mean_(ts)
    assert handle.is_completed()
    a = abs_sum64(node_inputs(1))
    exact = mean64(node_inputs(1))
    report["fp_vs_exact"] = max_excess(ts, exact, [U * x * 1.01 for x in a])
    report["fp_vs_all_reduce"] = max_excess(ts, as64(ref), [2 * U * x * 1.01 for x in a])
    report["fp_identical_in_node"] = bitwise_same_across(ts, group, L)
    plan = plan_buckets(ts, cap)
    report["fp_bytes"] = (stats.bytes_sent["intra"], stats.bytes_sent["inter"])
    report["fp_bytes_formula"] = sum(2 * (L - 1) * -(-b.numel // L) * 4 for b in plan)
    report["fp_messages"] = (stats.messages_sent["intra"], 2 * (L - 1) * len(plan))

    # 2. async: tensors untouched until wait(), then bitwise what the blocking call gave.
    report.update(check_async(IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB), rank, ts))

    # 3. bfloat16 in, float32 sums: within one rounding to bfloat16 of the exact mean.
    tb = make_tensors(rank, 2, torch.bfloat16)
    IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB).mean_(tb)
    exact_b = mean64(node_inputs(2, torch.bfloat16))
    a_b = abs_sum64(node_inputs(2, torch.bfloat16))
    # bfloat16 rounding: half an ulp = 2**-8 relative; plus the float32 sum error.
    report["bf16"] = max_excess(tb, exact_b, [2.0**-8 * e.abs() + U * x * 1.01
                                              for e, x in zip(exact_b, a_b, strict=True)])

    # 4. codec, one call from a zero residual, single and several buckets, async and not.
    report["codec"] = {}
    for bits, rounding, bucket_mb, async_op in CODEC_CASES:
        spec = QuantSpec(bits, BLOCK, rounding)
        st = CommStats()
        call = 10 + bits
        tq = make_tensors(rank, call)
        h = IntraNodeAllreduce(topo, bucket_mb=bucket_mb, spec=spec, stats=st,
                               seed=5).mean_(tq, async_op=async_op)
        h.wait()
        contribs = [as64(x) for x in node_inputs(call)]
        plan = plan_buckets(tq, max(1, int(bucket_mb * MIB)))
        bound = codec_error_bound(contribs, spec, plan, count_padding=False,
                                  slack=[torch.zeros_like(x) for x in contribs[0]])
        report["codec"][(bits, rounding)] = {
            "excess": max_excess(tq, mean64(node_inputs(call)), bound),
            "identical": bitwise_same_across(tq, group, L),
            "bytes": st.bytes_sent["intra"],
            "bytes_formula": sum((L - 1) * packed_nbytes(b.numel, spec) for b in plan),
        }

    # 5. error feedback over several calls (2 bits, new data each call): the running sum of
    #    results equals the running sum of exact means plus (1/L) sum_k (-residual_k), and the
    #    residual stays bounded by max_t block absmax(x_t) / (2 L_q - 1) (L_q = 1 for 2 bits:
    #    v = x + e, |e_new| <= absmax(v) / 2, so absmax(v) <= M + absmax(v_prev) / 2 <= 2M).
    spec = QuantSpec(2, BLOCK, "nearest")
    ef_ar = IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, spec=spec)
    calls = 6
    run_got = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    run_exact = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    tol = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    m_bound = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in node_ranks]
    plan = plan_buckets(make_tensors(rank, 0), cap)
    for c in range(calls):
        x = make_tensors(rank, 100 + c)
        ef_ar.mean_(x, key="ef")
        inputs = node_inputs(100 + c)
        for i, (g, e) in enumerate(zip(x, mean64(inputs), strict=True)):
            run_got[i] += g.double()
            run_exact[i] += e
        for k, xk in enumerate(inputs):
            am = per_block(as64(xk), plan, BLOCK, "absmax", False)
            m_bound[k] = [torch.maximum(p, q) for p, q in zip(m_bound[k], am, strict=True)]
        # float32 rounding of one call: decode and accumulate (the codec test's term) with
        # |v| and scales <= 2 * block absmax (see above), plus the running sum's own rounding.
        a = abs_sum64(inputs)
        for i in range(len(SHAPES)):
            tol[i] += (L + 3) * U * 4 * (a[i] + sum(mb[i] for mb in m_bound)) / L \
                + U * run_got[i].abs()
    residuals = [torch.zeros(s) for s in SHAPES]
    state = ef_ar.state_dict()["error_feedback"]["residuals"]
    for i, b in enumerate(plan):
        unpack(b, state[f"ef/{i}"], residuals)
    all_res = gather_lists(residuals, group, L)
    corrected = [run_got[i] + sum(r[i].double() for r in all_res) / L for i in range(len(SHAPES))]
    report["ef_identity"] = max_excess(corrected, run_exact, tol)
    report["ef_residual_bound"] = max(
        max_excess(all_res[k], [torch.zeros_like(t) for t in m_bound[k]],
                   [t * (1 + 1e-5) for t in m_bound[k]])
        for k in range(L)
    )
    report["ef_running_bound"] = max_excess(
        run_got, run_exact,
        [sum(mb[i] for mb in m_bound) * (1 + 1e-5) / L + tol[i] for i in range(len(SHAPES))])

    # 6. all_gather_into: concatenation by local rank.
    shard = torch.arange(5, dtype=torch.float32) + 10 * topo.local_rank
    out = torch.empty(5 * L)
    IntraNodeAllreduce(topo).all_gather_into(out, shard)
    report["all_gather_into"] = torch.equal(
        out, torch.cat([torch.arange(5.0) + 10 * i for i in range(L)]))

    # 7. empty input: nothing to do, nothing sent.
    st = CommStats()
    IntraNodeAllreduce(topo, stats=st).mean_([torch.empty(0), torch.empty(0, 3)])
    IntraNodeAllreduce(topo, stats=st).mean_([])
    report["empty_bytes"] = st.bytes_sent["intra"]

    # 8. bad input raises before any communication (so every rank raises alike).
    report["errors"] = _bad_inputs(topo, world_size)

    # 9. a single-stage async operation completes without wait(); wait() then applies it.
    tq = make_tensors(rank, 40)
    h = IntraNodeAllreduce(topo, spec=QuantSpec(8, BLOCK)).mean_(tq, async_op=True)
    deadline = time.monotonic() + 30
    while not h.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    report["polled_completed"] = h.is_completed()
    h.wait()

    # 10. (last: it leaves a collective in flight on rank 0) a late peer -> PeerTimeoutError.
    if world_size == 2:
        late = IntraNodeAllreduce(topo, spec=QuantSpec(8, BLOCK))
        if rank == 1:
            time.sleep(2.0)
        h = late.mean_([torch.ones(8)], async_op=True)
        if rank == 0:
            try:
                h.wait(timeout_s=0.3)
                report["timeout"] = None
            except PeerTimeoutError as e:
                report["timeout"] = (str(e), e.peers, e.timeout_s)
        else:
            h.wait()
    return report


def _raises(fn, exc) -> str:
    try:
        fn()
    except exc as e:
        return str(e)
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def _bad_inputs(topo: Topology, world_size: int) -> dict:
    ar = IntraNodeAllreduce(topo)
    q = IntraNodeAllreduce(topo, spec=QuantSpec(4, 32))
    x = torch.zeros(4)
    return {
        "dtype": _raises(lambda: ar.mean_([torch.zeros(3, dtype=torch.int32)]), TypeError),
        "f64_codec": _raises(lambda: q.mean_([torch.zeros(3, dtype=torch.float64)]), TypeError),
        "not_tensor": _raises(lambda: ar.mean_([x, 3.0]), TypeError),
        "bare_tensor": _raises(lambda: ar.mean_(x), TypeError),
        "devices": _raises(lambda: ar.mean_([x, torch.zeros(4, device="meta")]), ValueError),
        "contiguous": _raises(lambda: ar.mean_([torch.zeros(4, 4).t()]), ValueError),
        "bucket_zero": _raises(lambda: IntraNodeAllreduce(topo, bucket_mb=0), ValueError),
        "bucket_neg": _raises(lambda: IntraNodeAllreduce(topo, bucket_mb=-1.0), ValueError),
        "bucket_nan": _raises(lambda: IntraNodeAllreduce(topo, bucket_mb=math.nan), ValueError),
        "bucket_type": _raises(lambda: IntraNodeAllreduce(topo, bucket_mb="25"), TypeError),
        "spec": _raises(lambda: IntraNodeAllreduce(topo, spec=4), TypeError),
        "stats": _raises(lambda: IntraNodeAllreduce(topo, stats={}), TypeError),
        "topology": _raises(lambda: IntraNodeAllreduce(None), TypeError),
        "key": _raises(lambda: ar.mean_([x], key=1.5), TypeError),
        "gather_shape": _raises(lambda: ar.all_gather_into(torch.empty(3), x), ValueError),
        "wrong_world": _raises(
            lambda: IntraNodeAllreduce(Topology(1, rank=0, world_size=world_size + 2)).mean_(
                [x]), RuntimeError),
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world", "ppn"), [(4, 2), (2, 2)], ids=["2nodes_x2", "1node_x2"])
def test_intra_allreduce(world, ppn):
    reports = run_world(_intra_body, world, args=(ppn,), timeout_s=120)
    for rank, r in enumerate(reports):
        where = f"rank {rank}"
        assert r["fp_vs_exact"] <= 0, where
        assert r["fp_vs_all_reduce"] <= 0, where
        assert r["fp_identical_in_node"], where
        assert r["fp_bytes"] == (r["fp_bytes_formula"], 0), where
        assert r["fp_messages"][0] == r["fp_messages"][1], where
        assert r["async_untouched"] and r["async_equal_blocking"] and r["async_completed"], where
        assert r["bf16"] <= 0, where
        for cfg, c in r["codec"].items():
            assert c["excess"] <= 0, (where, cfg, c)
            assert c["identical"], (where, cfg)
            assert c["bytes"] == c["bytes_formula"], (where, cfg, c)
        assert r["ef_identity"] <= 0, (where, r["ef_identity"])
        assert r["ef_residual_bound"] <= 0, (where, r["ef_residual_bound"])
        assert r["ef_running_bound"] <= 0, (where, r["ef_running_bound"])
        assert r["all_gather_into"], where
        assert r["polled_completed"], where
        if world == 2 and rank == 0:
            msg, peers, timeout = r["timeout"]
            assert peers == [1] and timeout == 0.3 and "intra-node allreduce" in msg
            assert "intra-node link" in msg
        assert r["empty_bytes"] == 0, where
        e = r["errors"]
        assert "int32" in e["dtype"] and "tensors[0]" in e["dtype"]
        assert "float64" in e["f64_codec"]
        assert "tensors[1]" in e["not_tensor"]
        assert "sequence" in e["bare_tensor"]
        assert "one device" in e["devices"]
        assert "contiguous" in e["contiguous"]
        for k in ("bucket_zero", "bucket_neg", "bucket_nan", "bucket_type"):
            assert "bucket_mb" in e[k], k
        assert "spec" in e["spec"] and "stats" in e["stats"] and "topology" in e["topology"]
        assert "key" in e["key"] and "out" in e["gather_shape"]
        assert f"world_size {world + 2}" in e["wrong_world"]


def _one_proc_per_node_body(rank: int, world_size: int) -> dict:
    """With one process per node the intra-node mean is the tensor itself; nothing is sent."""
    topo = Topology(1)
    st = CommStats()
    ts = make_tensors(rank, 3)
    before = [t.clone() for t in ts]
    IntraNodeAllreduce(topo, stats=st, spec=QuantSpec(2, 32)).mean_(ts)
    out = torch.empty(4)
    IntraNodeAllreduce(topo, stats=st).all_gather_into(out, torch.ones(4))
    return {"same": all(torch.equal(a, b) for a, b in zip(ts, before, strict=True)),
            "bytes": st.snapshot()["bytes_sent"], "gather": torch.equal(out, torch.ones(4))}


@pytest.mark.timeout(150)
def test_intra_with_one_process_per_node_is_identity():
    for r in run_world(_one_proc_per_node_body, 3, timeout_s=120):
        assert r == {"same": True, "bytes": {"intra": 0, "inter": 0}, "gather": True}
