"""HierarchicalAllreduce on Gloo: bits=None against dist.all_reduce and the exact mean; bits 8,
4, 2, 1 against the bound the codec guarantees; error feedback over calls; async; bytes per
level; state_dict. Shapes: 2 nodes x 2, 3 x 1, 4 x 1, 1 node x 2, each behaviour its own test
in a session-wide Gloo world (the ``gloo`` fixture). The codec's rail runs in both forms (the
all-gather, and the reduce-scatter + all-gather of :mod:`qcomm.collectives.rail`) wherever there
are nodes to differ.

Bounds (see tests/collectives/test_intra.py for the codec terms; u = 2**-24, A = sum over all
ranks of |x| element-wise, L ranks per node, N nodes):

* bits=None: node mean in float32 is within u * A_k of the exact one (A_k: node k's |x| sum),
  the rail mean of N such values adds u * sum_k |m_k| <= u * A / L, so
  |result - exact| <= u * A * (1/N + 1/L); dist.all_reduce + division is within u * A.
* bits: each node's float32 shard mean v_k (within u * A_k of exact) is quantized; the decoded
  mean is within (1/N) sum_k codec_error(v_k) + float32 accumulation of the exact mean, with
  the codec's scales computed from blocks aligned to the bucket start (shards are
  block-aligned), padding counted as elements (it is part of a shard).
* the reduce-scatter form quantizes that decoded mean m once more (a chunk's owner, from a zero
  residual): its result is within B1 + codec_error(m) of the exact mean, B1 the bound above
  and m within B1 of the exact mean (the slack that raises the second stage's scales); the
  final decode of one payload at weight 1 is exact.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from qcomm.collectives import PeerError
from qcomm.collectives.buckets import MIB, plan_buckets, unpack
from qcomm.collectives.hierarchical import HierarchicalAllreduce, shard_numel
from qcomm.collectives.primitives import all_gather_flat
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import resolve_group
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.multiprocess import run_world
from tests.collectives.test_intra import (
    ASYNC_OK,
    BLOCK,
    SHAPES,
    SMALL_BUCKET_MB,
    U,
    abs_sum64,
    as64,
    assert_exact_and_identical,
    assert_within_bound,
    async_body,
    bitwise_same_across,
    codec_cases,
    codec_error_bound,
    make_tensors,
    max_excess,
    mean64,
    per_block,
    wrong_world_body,
)
from tests.worlds import topology


def expected_bytes(plan, L: int, N: int, spec: QuantSpec | None, elem: int,
                    rail: str = "all_gather") -> dict[str, int]:
    intra = inter = 0
    for b in plan:
        s = shard_numel(b.numel, L, N, spec, rail)
        if L > 1:
            intra += 2 * (L - 1) * s * elem  # reduce-scatter + all-gather of s-element shards
        if N > 1 and spec is None:
            inter += 2 * (N - 1) * (s // N) * elem
        elif N > 1 and rail == "all_gather":
            inter += (N - 1) * packed_nbytes(s, spec)
        elif N > 1:  # all-to-all of chunk payloads, then all-gather of the owner's chunk
            inter += 2 * (N - 1) * packed_nbytes(s // N, spec)
    return {"intra": intra, "inter": inter}


class World:
    """Inputs and bounds every rank of a world of ``W`` ranks, ``L`` per node, can recompute."""

    def __init__(self, world_size: int, ppn: int) -> None:
        self.W, self.L, self.N = world_size, ppn, world_size // ppn

    def everyone(self, call, dtype=torch.float32):
        return [make_tensors(r, call, dtype) for r in range(self.W)]

    def node_means(self, call, dtype=torch.float32):
        return [mean64(self.everyone(call, dtype)[k * self.L:(k + 1) * self.L])
                for k in range(self.N)]

    def node_abs(self, call, dtype=torch.float32):
        return [abs_sum64(self.everyone(call, dtype)[k * self.L:(k + 1) * self.L])
                for k in range(self.N)]

    def fp_bound(self, call, dtype=torch.float32):
        return [U * a * (1 / self.N + 1 / self.L) * 1.01
                for a in abs_sum64(self.everyone(call, dtype))]


def _full_precision_body(rank: int, world_size: int, ppn: int) -> dict:
    """bits=None, several buckets: exact mean, dist.all_reduce, identical on all ranks, bytes."""
    topo, w = topology(ppn), World(world_size, ppn)
    st = CommStats()
    ts = make_tensors(rank, 1)
    ref = [t.clone() for t in ts]
    for t in ref:
        dist.all_reduce(t)
        t.div_(world_size)
    HierarchicalAllreduce(topo, bucket_mb=SMALL_BUCKET_MB, stats=st).mean_(ts)
    a = abs_sum64(w.everyone(1))
    return {
        "vs_exact": max_excess(ts, mean64(w.everyone(1)), w.fp_bound(1)),
        "vs_all_reduce": max_excess(
            ts, as64(ref), [b + U * x * 1.01 for b, x in zip(w.fp_bound(1), a, strict=True)]),
        "identical": bitwise_same_across(ts, None, world_size),
        "bytes": (st.bytes_sent, expected_bytes(plan_buckets(ts, int(SMALL_BUCKET_MB * MIB)),
                                                 w.L, w.N, None, 4)),
    }


SHAPE_IDS = {(4, 2): "2nodes_x2", (3, 1): "3nodes_x1", (4, 1): "4nodes_x1", (2, 2): "1node_x2"}
shapes = pytest.mark.parametrize(("world", "ppn"), list(SHAPE_IDS), ids=list(SHAPE_IDS.values()))
# The codec's two rail forms, each on every shape where nodes differ (one node: no rail).
RAIL_CASES = [(w, p, r) for (w, p) in SHAPE_IDS for r in ("all_gather", "reduce_scatter")
              if w // p > 1 or r == "all_gather"]
rail_shapes = pytest.mark.parametrize(
    ("world", "ppn", "rail"), RAIL_CASES,
    ids=[f"{SHAPE_IDS[(w, p)]}-{r}" for w, p, r in RAIL_CASES])


@shapes
def test_full_precision_mean_is_exact_and_the_same_on_every_rank(gloo, world, ppn):
    assert_exact_and_identical(gloo.run(_full_precision_body, world, args=(ppn,)))


@shapes
def test_full_precision_bytes_per_level(gloo, world, ppn):
    for rank, r in enumerate(gloo.run(_full_precision_body, world, args=(ppn,))):
        got, want = r["bytes"]
        assert got == want, (rank, got, want)


@shapes
def test_async_leaves_tensors_alone_until_wait(gloo, world, ppn):
    for rank, r in enumerate(gloo.run(async_body, world, args=(ppn, HierarchicalAllreduce))):
        assert r == ASYNC_OK, rank


def codec_mean_bound(w: World, call: int, spec: QuantSpec, plan, rail: str
                     ) -> list[torch.Tensor]:
    """Per element, how far one codec call (zero residuals) may land from the exact mean of
    call ``call``'s tensors (see the module docstring)."""
    if w.N == 1:
        return w.fp_bound(call)  # one node: no codec (nothing crosses a slow link)
    bound = codec_error_bound(w.node_means(call), spec, plan, count_padding=True,
                              slack=[U * x for x in abs_sum64(w.everyone(call))])
    bound = [b + f for b, f in zip(bound, w.fp_bound(call), strict=True)]
    if rail == "reduce_scatter":  # the owner quantizes a mean within `bound` of exact
        second = codec_error_bound([mean64(w.everyone(call))], spec, plan, count_padding=True,
                                   slack=bound)
        bound = [b + t for b, t in zip(bound, second, strict=True)]
    return bound


def _codec_body(rank: int, world_size: int, ppn: int, case: tuple, rail: str) -> dict:
    """One call from zero residuals, against the codec's bound."""
    bits, rounding, bucket_mb, async_op = case
    topo, w = topology(ppn), World(world_size, ppn)
    spec = QuantSpec(bits, BLOCK, rounding)
    call = 20 + bits
    st = CommStats()
    tq = make_tensors(rank, call)
    HierarchicalAllreduce(topo, spec=spec, bucket_mb=bucket_mb, stats=st, seed=3,
                          rail_collective=rail).mean_(tq, async_op=async_op).wait()
    plan = plan_buckets(tq, max(1, int(bucket_mb * MIB)))
    return {
        "excess": max_excess(tq, mean64(w.everyone(call)),
                             codec_mean_bound(w, call, spec, plan, rail)),
        "identical": bitwise_same_across(tq, None, world_size),
        "bytes": (st.bytes_sent, expected_bytes(plan, w.L, w.N, spec, 4, rail)),
    }


@rail_shapes
@codec_cases
def test_codec_mean_within_its_bound(gloo, world, ppn, rail, case):
    assert_within_bound(gloo.run(_codec_body, world, args=(ppn, case, rail)))


def _bf16_body(rank: int, world_size: int, ppn: int, rail: str) -> float:
    """bfloat16 input, 8 bits: the codec bound plus one rounding to bfloat16 at the end."""
    topo, w = topology(ppn), World(world_size, ppn)
    spec = QuantSpec(8, BLOCK)
    tb = make_tensors(rank, 30, torch.bfloat16)
    HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB,
                          rail_collective=rail).mean_(tb)
    plan = plan_buckets(tb, int(SMALL_BUCKET_MB * MIB))
    exact_b = mean64(w.everyone(30, torch.bfloat16))
    fb = w.fp_bound(30, torch.bfloat16)
    if w.N > 1:
        cb = codec_error_bound(w.node_means(30, torch.bfloat16), spec, plan, count_padding=True,
                               slack=[U * x for x in abs_sum64(w.everyone(30, torch.bfloat16))])
        # Without a spec the node means are rounded to bfloat16 before the rail (wire dtype);
        # with one they are quantized from float32: no extra rounding there.
        fb = [c + f for c, f in zip(cb, fb, strict=True)]
        if rail == "reduce_scatter":
            second = codec_error_bound([exact_b], spec, plan, count_padding=True, slack=fb)
            fb = [f + t for f, t in zip(fb, second, strict=True)]
    return max_excess(
        tb, exact_b, [f + 2.0**-8 * (e.abs() + f) for f, e in zip(fb, exact_b, strict=True)])


@rail_shapes
def test_bfloat16_within_the_codec_bound_plus_one_rounding(gloo, world, ppn, rail):
    assert all(e <= 0 for e in gloo.run(_bf16_body, world, args=(ppn, rail)))


def _error_feedback_body(rank: int, world_size: int, ppn: int, rail: str) -> dict:
    """Several calls (2 bits): sum of results + mean_k residual_k (+ the owners' residuals in
    the reduce-scatter form) equals the sum of exact means, and every residual stays bounded:
    a node's within max_t block absmax of its mean, an owner's within twice the largest."""
    topo, w = topology(ppn), World(world_size, ppn)
    L, N = w.L, w.N
    spec = QuantSpec(2, BLOCK)
    ar = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, rail_collective=rail)
    two_stage = N > 1 and ar.rail_form == "reduce_scatter"
    plan = plan_buckets(make_tensors(rank, 0), int(SMALL_BUCKET_MB * MIB))
    run_got = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    run_exact = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    tol = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    m_bound = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(N)]
    for c in range(5):
        x = make_tensors(rank, 200 + c)
        ar.mean_(x, key="ef")
        for i, (g, e) in enumerate(zip(x, mean64(w.everyone(200 + c)), strict=True)):
            run_got[i] += g.double()
            run_exact[i] += e
        means, absn = w.node_means(200 + c), w.node_abs(200 + c)
        for k in range(N):
            am = per_block([m + U * n for m, n in zip(means[k], absn[k], strict=True)], plan,
                           BLOCK, "absmax", True)
            m_bound[k] = [torch.maximum(p, q) for p, q in zip(m_bound[k], am, strict=True)]
        a = abs_sum64(w.everyone(200 + c))
        for i in range(len(SHAPES)):
            # Per call: node-mean rounding, decode/accumulate rounding with |v|, scale <= 2M,
            # and the running sum's own rounding; the owner's stage rounds values <= 4M.
            mb = sum(m[i] for m in m_bound)
            tol[i] += U * a[i] * (1 / N + 1 / L) * 1.01 + U * run_got[i].abs() + (
                (N + 3) * U * 4 * mb / N if N > 1 else 0) + (8 * U * 4 * mb if two_stage else 0)
    residuals = _node_residuals(ar, plan, topo) if N > 1 else [
        [torch.zeros(s) for s in SHAPES]]
    owners = _owner_residuals(ar, plan, topo) if two_stage else [torch.zeros(s) for s in SHAPES]
    corrected = [run_got[i] + sum(r[i].double() for r in residuals) / N + owners[i].double()
                 for i in range(len(SHAPES))]
    out = {"identity": max_excess(corrected, run_exact, tol), "residual_bound": -1.0}
    if N > 1:
        out["residual_bound"] = max(
            max_excess(residuals[k], [torch.zeros_like(t) for t in m_bound[k]],
                       [t * (1 + 1e-5) for t in m_bound[k]]) for k in range(N))
    if two_stage:
        largest = [torch.stack([m[i] for m in m_bound]).amax(0) for i in range(len(SHAPES))]
        out["residual_bound"] = max(out["residual_bound"], max_excess(
            owners, [torch.zeros_like(t) for t in largest], [2 * t for t in largest]))
    return out


@rail_shapes
def test_error_feedback_carries_the_residual_over_calls(gloo, world, ppn, rail):
    for rank, r in enumerate(gloo.run(_error_feedback_body, world, args=(ppn, rail))):
        assert r["identity"] <= 0, (rank, r)
        assert r["residual_bound"] <= 0, (rank, r)


def _state_dict_body(rank: int, world_size: int, ppn: int, rail: str) -> bool:
    """A fresh instance loaded with the state continues bit-identically (stochastic rounding,
    so the call count that seeds it matters too; both residuals in the two-stage form)."""
    topo = topology(ppn)
    spec = QuantSpec(4, BLOCK, "stochastic")
    a1 = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, seed=9,
                               rail_collective=rail)
    for c in range(2):
        a1.mean_(make_tensors(rank, 300 + c))
    a2 = HierarchicalAllreduce(topo, spec=spec, bucket_mb=SMALL_BUCKET_MB, seed=9,
                               rail_collective=rail)
    a2.load_state_dict(a1.state_dict())
    y1, y2 = make_tensors(rank, 302), make_tensors(rank, 302)
    a1.mean_(y1)
    a2.mean_(y2)
    return all(torch.equal(p, q) for p, q in zip(y1, y2, strict=True))


@rail_shapes
def test_state_dict_resumes_bit_identically(gloo, world, ppn, rail):
    assert all(gloo.run(_state_dict_body, world, args=(ppn, rail)))


def _empty_body(rank: int, world_size: int, ppn: int) -> dict:
    topo = topology(ppn)
    st = CommStats()
    HierarchicalAllreduce(topo, spec=QuantSpec(4, 32), stats=st).mean_([torch.empty(0)])
    HierarchicalAllreduce(topo, stats=st).mean_([])
    return st.bytes_sent


@shapes
def test_empty_tensors_send_nothing(gloo, world, ppn):
    assert gloo.run(_empty_body, world, args=(ppn,)) == [{"intra": 0, "inter": 0}] * world


def test_topology_of_another_world_raises_before_communicating(gloo):
    msgs = gloo.run(wrong_world_body, 4, args=(HierarchicalAllreduce, 1))
    assert all("world_size 5" in msg for msg in msgs)


_TOPO = Topology(2, rank=0, world_size=4)


@pytest.mark.parametrize(("make", "exc", "word"), [
    (lambda: HierarchicalAllreduce(_TOPO, spec="4bit"), TypeError, "spec"),
    (lambda: HierarchicalAllreduce(_TOPO, bucket_mb=0.0), ValueError, "bucket_mb"),
    (lambda: HierarchicalAllreduce(_TOPO).mean_([torch.zeros(2, dtype=torch.int64)]),
     TypeError, "int64"),
    (lambda: HierarchicalAllreduce(_TOPO).mean_([torch.zeros(3, 2).t()]), ValueError,
     "contiguous"),
    (lambda: HierarchicalAllreduce(_TOPO).load_state_dict({"calls": 1}), ValueError, "state"),
], ids=["spec", "bucket_mb", "dtype", "contiguous", "state"])
def test_bad_input_raises_before_communicating(make, exc, word):
    with pytest.raises(exc, match=word):
        make()


def _node_residuals(ar: HierarchicalAllreduce, plan, topo: Topology) -> list[list[torch.Tensor]]:
    """Node k's residual as tensors shaped like SHAPES: the concatenation, by local rank, of the
    shard residuals its ranks hold (gathered over the world)."""
    L, N, W = topo.procs_per_node, topo.num_nodes, topo.world_size
    state = ar.state_dict()["error_feedback"]["residuals"]
    out = [[torch.zeros(s) for s in SHAPES] for _ in range(N)]
    for i, b in enumerate(plan):
        mine = state[f"ef/{i}"]
        rows = torch.empty(W * mine.numel())
        all_gather_flat(rows, mine, resolve_group(None))
        rows = rows.view(N, L * mine.numel())
        for k in range(N):
            unpack(b, rows[k], out[k])
    return out


def _owner_residuals(ar: HierarchicalAllreduce, plan, topo: Topology) -> list[torch.Tensor]:
    """The owners' residuals (second stage) as tensors shaped like SHAPES: shard l of a bucket
    is the concatenation, by node, of the chunks its owners (local rank l of each node) hold."""
    L, N, W = topo.procs_per_node, topo.num_nodes, topo.world_size
    state = ar.state_dict()["error_feedback"]["residuals"]
    out = [torch.zeros(s) for s in SHAPES]
    for i, b in enumerate(plan):
        mine = state[f"ef/{i}/owner"]
        rows = torch.empty(W * mine.numel())
        all_gather_flat(rows, mine, resolve_group(None))
        rows = rows.view(N, L, mine.numel())  # global rank k * L + l: node k, local rank l
        unpack(b, rows.transpose(0, 1).reshape(-1), out)
    return out


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


@pytest.mark.parametrize(("numel", "L", "N", "bits", "rail", "want"), [
    (261, 2, 2, 4, "all_gather", 160), (261, 2, 2, None, "all_gather", 132),
    (261, 1, 3, None, "all_gather", 261), (261, 1, 3, 4, "all_gather", 288),
    (261, 2, 1, 4, "all_gather", 131), (0, 2, 2, 4, "all_gather", 0),
    (1, 4, 4, 8, "all_gather", 32), (261, 1, 3, 4, "reduce_scatter", 288),
    (261, 2, 4, 4, "reduce_scatter", 256), (1, 1, 8, 4, "reduce_scatter", 256),
    (261, 2, 1, 4, "reduce_scatter", 131), (261, 2, 2, None, "reduce_scatter", 132),
])
def test_shard_numel_is_equal_and_aligned(numel, L, N, bits, rail, want):
    spec = QuantSpec(bits, 32) if bits else None
    s = shard_numel(numel, L, N, spec, rail)
    assert s == want and L * s >= numel
    if N > 1:
        unit = 32 * (N if rail == "reduce_scatter" else 1) if spec else N
        assert s % unit == 0


@pytest.mark.parametrize(("nodes", "want"), [(1, "all_gather"), (2, "all_gather"),
                                             (3, "reduce_scatter"), (8, "reduce_scatter")])
def test_auto_takes_the_reduce_scatter_from_three_nodes(nodes, want):
    topo = Topology(1, rank=0, world_size=nodes)
    assert HierarchicalAllreduce(topo, spec=QuantSpec(4, 32)).rail_form == want
    forced = HierarchicalAllreduce(topo, rail_collective="all_gather")
    assert forced.rail_form == "all_gather"


def test_bad_rail_collective_names_itself_and_the_choices():
    with pytest.raises(ValueError, match=r"rail_collective.*all_gather.*reduce_scatter"):
        HierarchicalAllreduce(_TOPO, rail_collective="ring")


def test_state_of_the_other_rail_form_is_refused_and_nothing_is_loaded():
    topo = Topology(1, rank=0, world_size=4)
    spec = QuantSpec(4, 32)
    saved = HierarchicalAllreduce(topo, spec=spec, rail_collective="all_gather").state_dict()
    target = HierarchicalAllreduce(topo, spec=spec)  # auto: the reduce-scatter at 4 nodes
    before = target.state_dict()
    with pytest.raises(ValueError, match=r"rail_form.*all_gather.*reduce_scatter"):
        target.load_state_dict(saved)
    assert target.state_dict() == before


@pytest.mark.parametrize("nodes", [3, 4, 8, 16])
def test_reduce_scatter_bytes_per_node_stay_flat_in_the_node_count(nodes):
    """By the byte formula the hook's stats follow (counted against it in the Gloo tests):
    2 (N-1)/N payloads against N-1; for a 1 MiB bucket at 4 bits in blocks of 128."""
    spec = QuantSpec(4, 128)
    numel = 1 << 18
    plan = plan_buckets([torch.zeros(numel)], 1 << 22)
    ag = expected_bytes(plan, 1, nodes, spec, 4, "all_gather")["inter"]
    rs = expected_bytes(plan, 1, nodes, spec, 4, "reduce_scatter")["inter"]
    assert rs / ag == pytest.approx(2 / nodes, rel=1e-3)
    assert rs <= 2 * packed_nbytes(numel, spec)


# ---------------------------------------------------------------------------------------------
# a node that dies in the middle of the reduce-scatter form: the others name it, change no
# residual, and do not hang

DEAD_TIMEOUT_S = 3.0
DEAD_MARGIN_S = 2.0  # scheduling slack on a loaded 2-core machine


def _dead_node_body(rank: int, world_size: int) -> dict | None:
    """4 nodes x 1: two calls succeed, then node 3 exits before the third call."""
    topo = Topology(1)
    ar = HierarchicalAllreduce(topo, spec=QuantSpec(4, BLOCK), rail_collective="reduce_scatter",
                               timeout_s=DEAD_TIMEOUT_S)
    for call in (1, 2):
        ar.mean_(make_tensors(rank, call), key="k")
    if rank == world_size - 1:
        os._exit(3)  # killed: no clean-up, the kernel closes its sockets
    before = {k: ar.error_feedback.residual(k).clone() for k in ar.error_feedback.keys()}  # noqa: SIM118
    ts = make_tensors(rank, 3)
    t0 = time.monotonic()
    try:
        ar.mean_(ts, key="k")
    except PeerError as e:
        after = {k: ar.error_feedback.residual(k) for k in ar.error_feedback.keys()}  # noqa: SIM118
        return {"type": type(e).__name__, "peers": e.peers, "msg": str(e),
                "elapsed": time.monotonic() - t0,
                "residuals_kept": before.keys() == after.keys() and all(
                    torch.equal(before[k], after[k]) for k in before),
                "tensors_kept": all(torch.equal(a, b)
                                    for a, b in zip(ts, make_tensors(rank, 3), strict=True))}
    return None


@pytest.mark.timeout(150)
def test_a_dead_node_in_the_reduce_scatter_is_named_and_no_residual_moves():
    world = 4
    res = run_world(_dead_node_body, world, timeout_s=120, allow_exit={world - 1})
    for r in res[:-1]:
        assert r is not None, "the call went through without the dead node"
        assert r["type"] in ("PeerLostError", "PeerTimeoutError"), r
        assert world - 1 in r["peers"] and "inter-node" in r["msg"], r
        assert r["elapsed"] <= DEAD_TIMEOUT_S + DEAD_MARGIN_S, r
        assert r["residuals_kept"], "a residual moved for a mean nobody applied"
        assert r["tensors_kept"], "the tensors were written by a failed mean"
