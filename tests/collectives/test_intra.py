"""IntraNodeAllreduce on Gloo: full precision against dist.all_reduce and the exact mean, the
codec against the bound it guarantees, error feedback over calls, async, bytes, bad input.
Each behaviour is its own test, run in a session-wide Gloo world (the ``gloo`` fixture) of
2 nodes x 2 ranks or 1 node x 2.

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
from qcomm.collectives.primitives import all_gather_flat
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.multiprocess import run_world
from tests.worlds import topology

U = 2.0**-24
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
    all_gather_flat(out, flat, resolve_group(group))
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
# bodies: one behaviour each, run on every rank of a pooled world

# (world size, ranks per node)
LAYOUTS = [(4, 2), (2, 2)]
LAYOUT_IDS = ["2nodes_x2", "1node_x2"]
layouts = pytest.mark.parametrize(("world", "ppn"), LAYOUTS, ids=LAYOUT_IDS)


def _node_inputs(topo: Topology, call: int, dtype: torch.dtype = torch.float32
                 ) -> list[list[torch.Tensor]]:
    return [make_tensors(r, call, dtype) for r in topo.node_ranks]


def _full_precision_body(rank: int, world_size: int, ppn: int) -> dict:
    """Blocking, several buckets: against the exact mean and against dist.all_reduce."""
    topo = topology(ppn)
    stats = CommStats()
    ts = make_tensors(rank, 1)
    ref = [t.clone() for t in ts]
    for t in ref:
        dist.all_reduce(t, group=topo.intra_group)
        t.div_(ppn)
    handle = IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, stats=stats).mean_(ts)
    a = abs_sum64(_node_inputs(topo, 1))
    plan = plan_buckets(ts, int(SMALL_BUCKET_MB * MIB))
    return {
        "completed": handle.is_completed(),
        "vs_exact": max_excess(ts, mean64(_node_inputs(topo, 1)), [U * x * 1.01 for x in a]),
        "vs_all_reduce": max_excess(ts, as64(ref), [2 * U * x * 1.01 for x in a]),
        "identical": bitwise_same_across(ts, topo.intra_group, ppn),
        "bytes": (stats.bytes_sent["intra"], stats.bytes_sent["inter"]),
        "bytes_formula": sum(2 * (ppn - 1) * -(-b.numel // ppn) * 4 for b in plan),
        "messages": (stats.messages_sent["intra"], 2 * (ppn - 1) * len(plan)),
    }


def assert_exact_and_identical(reports: list[dict]) -> None:
    """Every rank's full-precision mean within its bounds of the exact mean and of
    dist.all_reduce, and the same bytes on every rank."""
    for rank, r in enumerate(reports):
        assert r["vs_exact"] <= 0, (rank, r["vs_exact"])
        assert r["vs_all_reduce"] <= 0, (rank, r["vs_all_reduce"])
        assert r["identical"], rank


@layouts
def test_full_precision_mean_is_exact_and_the_same_on_every_rank(gloo, world, ppn):
    reports = gloo.run(_full_precision_body, world, args=(ppn,))
    assert_exact_and_identical(reports)
    assert all(r["completed"] for r in reports)


@layouts
def test_full_precision_bytes_and_messages(gloo, world, ppn):
    for rank, r in enumerate(gloo.run(_full_precision_body, world, args=(ppn,))):
        assert r["bytes"] == (r["bytes_formula"], 0), rank
        assert r["messages"][0] == r["messages"][1], rank


def async_body(rank: int, world_size: int, ppn: int, allreduce: type) -> dict:
    """``check_async`` of ``allreduce`` (IntraNodeAllreduce or HierarchicalAllreduce) against
    its own blocking result."""
    topo = topology(ppn)
    blocking = make_tensors(rank, 1)
    allreduce(topo, bucket_mb=SMALL_BUCKET_MB).mean_(blocking)
    return check_async(allreduce(topo, bucket_mb=SMALL_BUCKET_MB), rank, blocking)


ASYNC_OK = {"async_untouched": True, "async_equal_blocking": True, "async_completed": True}


@layouts
def test_async_leaves_tensors_alone_until_wait(gloo, world, ppn):
    for rank, r in enumerate(gloo.run(async_body, world, args=(ppn, IntraNodeAllreduce))):
        assert r == ASYNC_OK, rank


def _bf16_body(rank: int, world_size: int, ppn: int) -> float:
    """bfloat16 in, float32 sums: within one rounding to bfloat16 of the exact mean."""
    topo = topology(ppn)
    tb = make_tensors(rank, 2, torch.bfloat16)
    IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB).mean_(tb)
    exact_b = mean64(_node_inputs(topo, 2, torch.bfloat16))
    a_b = abs_sum64(_node_inputs(topo, 2, torch.bfloat16))
    # bfloat16 rounding: half an ulp = 2**-8 relative; plus the float32 sum error.
    return max_excess(tb, exact_b, [2.0**-8 * e.abs() + U * x * 1.01
                                    for e, x in zip(exact_b, a_b, strict=True)])


@layouts
def test_bfloat16_is_summed_in_float32(gloo, world, ppn):
    assert all(e <= 0 for e in gloo.run(_bf16_body, world, args=(ppn,)))


def _codec_body(rank: int, world_size: int, ppn: int, case: tuple) -> dict:
    """One call from a zero residual, against the bound the codec guarantees."""
    bits, rounding, bucket_mb, async_op = case
    topo = topology(ppn)
    spec = QuantSpec(bits, BLOCK, rounding)
    st = CommStats()
    call = 10 + bits
    tq = make_tensors(rank, call)
    IntraNodeAllreduce(topo, bucket_mb=bucket_mb, spec=spec, stats=st,
                       seed=5).mean_(tq, async_op=async_op).wait()
    contribs = [as64(x) for x in _node_inputs(topo, call)]
    plan = plan_buckets(tq, max(1, int(bucket_mb * MIB)))
    bound = codec_error_bound(contribs, spec, plan, count_padding=False,
                              slack=[torch.zeros_like(x) for x in contribs[0]])
    return {
        "excess": max_excess(tq, mean64(_node_inputs(topo, call)), bound),
        "identical": bitwise_same_across(tq, topo.intra_group, ppn),
        "bytes": (st.bytes_sent["intra"],
                  sum((ppn - 1) * packed_nbytes(b.numel, spec) for b in plan)),
    }


codec_cases = pytest.mark.parametrize("case", CODEC_CASES,
                                      ids=lambda c: f"{c[0]}bit-{c[1]}-{c[3] and 'async'}")


def assert_within_bound(reports: list[dict]) -> None:
    """Every rank's codec mean within the bound, the same bytes on every rank, and the bytes
    sent as the formula says (``r["bytes"]``: (counted, formula))."""
    for rank, r in enumerate(reports):
        assert r["excess"] <= 0, (rank, r)
        assert r["identical"], rank
        assert r["bytes"][0] == r["bytes"][1], (rank, r["bytes"])


@layouts
@codec_cases
def test_codec_mean_within_its_bound(gloo, world, ppn, case):
    assert_within_bound(gloo.run(_codec_body, world, args=(ppn, case)))


def _error_feedback_body(rank: int, world_size: int, ppn: int) -> dict:
    """Several calls (2 bits, new data each call): the running sum of results equals the running
    sum of exact means plus (1/L) sum_k (-residual_k), and the residual stays bounded by
    max_t block absmax(x_t) / (2 L_q - 1) (L_q = 1 for 2 bits: v = x + e, |e_new| <=
    absmax(v) / 2, so absmax(v) <= M + absmax(v_prev) / 2 <= 2M)."""
    topo = topology(ppn)
    L = ppn
    spec = QuantSpec(2, BLOCK, "nearest")
    ef_ar = IntraNodeAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, spec=spec)
    run_got = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    run_exact = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    tol = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    m_bound = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in topo.node_ranks]
    plan = plan_buckets(make_tensors(rank, 0), int(SMALL_BUCKET_MB * MIB))
    for c in range(6):
        x = make_tensors(rank, 100 + c)
        ef_ar.mean_(x, key="ef")
        inputs = _node_inputs(topo, 100 + c)
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
    all_res = gather_lists(residuals, topo.intra_group, L)
    corrected = [run_got[i] + sum(r[i].double() for r in all_res) / L for i in range(len(SHAPES))]
    return {
        "identity": max_excess(corrected, run_exact, tol),
        "residual_bound": max(
            max_excess(all_res[k], [torch.zeros_like(t) for t in m_bound[k]],
                       [t * (1 + 1e-5) for t in m_bound[k]]) for k in range(L)),
        "running_bound": max_excess(
            run_got, run_exact,
            [sum(mb[i] for mb in m_bound) * (1 + 1e-5) / L + tol[i] for i in range(len(SHAPES))]),
    }


@layouts
def test_error_feedback_carries_the_residual_over_calls(gloo, world, ppn):
    for rank, r in enumerate(gloo.run(_error_feedback_body, world, args=(ppn,))):
        assert r["identity"] <= 0, (rank, r)
        assert r["residual_bound"] <= 0, (rank, r)
        assert r["running_bound"] <= 0, (rank, r)


def _all_gather_into_body(rank: int, world_size: int, ppn: int) -> bool:
    topo = topology(ppn)
    shard = torch.arange(5, dtype=torch.float32) + 10 * topo.local_rank
    out = torch.empty(5 * ppn)
    IntraNodeAllreduce(topo).all_gather_into(out, shard)
    return torch.equal(out, torch.cat([torch.arange(5.0) + 10 * i for i in range(ppn)]))


@layouts
def test_all_gather_into_concatenates_by_local_rank(gloo, world, ppn):
    assert all(gloo.run(_all_gather_into_body, world, args=(ppn,)))


def _empty_body(rank: int, world_size: int, ppn: int) -> int:
    topo = topology(ppn)
    st = CommStats()
    IntraNodeAllreduce(topo, stats=st).mean_([torch.empty(0), torch.empty(0, 3)])
    IntraNodeAllreduce(topo, stats=st).mean_([])
    return st.bytes_sent["intra"]


@layouts
def test_empty_input_sends_nothing(gloo, world, ppn):
    assert gloo.run(_empty_body, world, args=(ppn,)) == [0] * world


def _polled_body(rank: int, world_size: int, ppn: int) -> bool:
    """A single-stage async operation completes without wait(); wait() then applies it."""
    h = IntraNodeAllreduce(topology(ppn), spec=QuantSpec(8, BLOCK)).mean_(
        make_tensors(rank, 40), async_op=True)
    deadline = time.monotonic() + 30
    while not h.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    done = h.is_completed()
    h.wait()
    return done


@layouts
def test_single_stage_handle_completes_by_polling(gloo, world, ppn):
    assert all(gloo.run(_polled_body, world, args=(ppn,)))


def wrong_world_body(rank: int, world_size: int, allreduce: type, extra: int) -> str:
    """The error of ``allreduce`` on a topology of ``world_size + extra`` ranks."""
    try:
        allreduce(Topology(1, rank=0, world_size=world_size + extra)).mean_([torch.zeros(4)])
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a topology of another world was accepted")


def test_topology_of_another_world_raises_before_communicating(gloo):
    for msg in gloo.run(wrong_world_body, 2, args=(IntraNodeAllreduce, 2)):
        assert "world_size 4" in msg


def _late_peer_body(rank: int, world_size: int) -> object:
    """Rank 1 joins 2 s late; rank 0 waits 0.3 s. Leaves a collective in flight on rank 0, so
    it runs in a world of its own."""
    topo = Topology(2)
    _ = topo.intra_group  # group creation is collective: before the delay
    late = IntraNodeAllreduce(topo, spec=QuantSpec(8, BLOCK))
    if rank == 1:
        time.sleep(2.0)
    h = late.mean_([torch.ones(8)], async_op=True)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        h.wait()
        store.set("late_peer_done", "1")
        return None
    try:
        h.wait(timeout_s=0.3)
    except PeerTimeoutError as e:
        out = (str(e), e.peers, e.timeout_s)
    else:
        out = None
    # Rank 1's collective completes with rank 0's, still in flight here: rank 0 leaving at once
    # would close the connection under it (ranks leave as soon as they are done).
    store.wait(["late_peer_done"])
    return out


@pytest.mark.timeout(150)
def test_a_late_peer_raises_peer_timeout_error_naming_it():
    msg, peers, timeout = run_world(_late_peer_body, 2, timeout_s=120)[0]
    assert peers == [1] and timeout == 0.3 and "intra-node allreduce" in msg
    assert "intra-node link" in msg


# ---------------------------------------------------------------------------------------------
# bad input raises before any communication (so every rank raises alike): one process suffices

_TOPO = Topology(2, rank=0, world_size=2)
_X = torch.zeros(4)


@pytest.mark.parametrize(("make", "exc", "words"), [
    (lambda: IntraNodeAllreduce(_TOPO).mean_([torch.zeros(3, dtype=torch.int32)]), TypeError,
     ("int32", "tensors[0]")),
    (lambda: IntraNodeAllreduce(_TOPO, spec=QuantSpec(4, 32)).mean_(
        [torch.zeros(3, dtype=torch.float64)]), TypeError, ("float64",)),
    (lambda: IntraNodeAllreduce(_TOPO).mean_([_X, 3.0]), TypeError, ("tensors[1]",)),
    (lambda: IntraNodeAllreduce(_TOPO).mean_(_X), TypeError, ("sequence",)),
    (lambda: IntraNodeAllreduce(_TOPO).mean_([_X, torch.zeros(4, device="meta")]), ValueError,
     ("one device",)),
    (lambda: IntraNodeAllreduce(_TOPO).mean_([torch.zeros(4, 4).t()]), ValueError,
     ("contiguous",)),
    (lambda: IntraNodeAllreduce(_TOPO, bucket_mb=0), ValueError, ("bucket_mb",)),
    (lambda: IntraNodeAllreduce(_TOPO, bucket_mb=-1.0), ValueError, ("bucket_mb",)),
    (lambda: IntraNodeAllreduce(_TOPO, bucket_mb=math.nan), ValueError, ("bucket_mb",)),
    (lambda: IntraNodeAllreduce(_TOPO, bucket_mb="25"), TypeError, ("bucket_mb",)),
    (lambda: IntraNodeAllreduce(_TOPO, spec=4), TypeError, ("spec",)),
    (lambda: IntraNodeAllreduce(_TOPO, stats={}), TypeError, ("stats",)),
    (lambda: IntraNodeAllreduce(None), TypeError, ("topology",)),
    (lambda: IntraNodeAllreduce(_TOPO).mean_([_X], key=1.5), TypeError, ("key",)),
    (lambda: IntraNodeAllreduce(_TOPO).all_gather_into(torch.empty(3), _X), ValueError,
     ("out",)),
], ids=["dtype", "f64_codec", "not_tensor", "bare_tensor", "devices", "contiguous",
        "bucket_zero", "bucket_neg", "bucket_nan", "bucket_type", "spec", "stats", "topology",
        "key", "gather_shape"])
def test_bad_input_raises_naming_the_argument(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    assert all(w in str(info.value) for w in words), str(info.value)


# ---------------------------------------------------------------------------------------------


def _one_proc_per_node_body(rank: int, world_size: int) -> dict:
    """With one process per node the intra-node mean is the tensor itself; nothing is sent."""
    topo = topology(1)
    st = CommStats()
    ts = make_tensors(rank, 3)
    before = [t.clone() for t in ts]
    IntraNodeAllreduce(topo, stats=st, spec=QuantSpec(2, 32)).mean_(ts)
    out = torch.empty(4)
    IntraNodeAllreduce(topo, stats=st).all_gather_into(out, torch.ones(4))
    return {"same": all(torch.equal(a, b) for a, b in zip(ts, before, strict=True)),
            "bytes": st.snapshot()["bytes_sent"], "gather": torch.equal(out, torch.ones(4))}


def test_intra_with_one_process_per_node_is_identity(gloo):
    for r in gloo.run(_one_proc_per_node_body, 3):
        assert r == {"same": True, "bytes": {"intra": 0, "inter": 0}, "gather": True}
