"""Bit-exact parity of the Triton codec (qcomm.kernels.triton_codec) with the torch reference.

Inputs go to the ``device`` fixture (CPU tensors under TRITON_INTERPRET=1, CUDA when
bench/gpu_check.sh runs compiled Triton); the oracle always runs on CPU copies. Everything is
compared exactly: payload bytes with torch.equal, floats through their int bit patterns. The
only normalization is of NaN bit patterns (sign and payload of a NaN produced by arithmetic
differ between x86, numpy and CUDA; the wire format only promises "NaN"): every NaN is
rewritten to one canonical NaN before the bitwise comparison. Scales of non-finite blocks are
compared as raw bytes, so their exact NaN (0x7FC00000) is checked.

Sizes stay small (a few thousand elements; blocks of 32-256 mostly) because interpreted
kernels cost ~10 ms per launch.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qcomm import compress
from qcomm.kernels import counter_hash, reference, triton_codec
from qcomm.kernels.accumulate_guard import AccumulateGuard, guard_total, slack_factor
from qcomm.kernels.wire_format import QuantSpec, num_blocks, packed_nbytes, split_payload

# numpy, which runs the interpreted kernels, warns on inf * 0 and inf - inf in NaN blocks.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ERROR_MODES = ("none", "in", "out", "in_out", "alias")

# Compiled Triton (bench/gpu_check.sh) builds one binary per combination of constexprs and of
# the "divisible by 16" flags of its int arguments, ~0.5-1 s each; the interpreter builds none.
# So on a GPU the property tests draw values as freely as here but code widths, block sizes,
# dtypes and sizes from a small set (~90 binaries in all): the interpreter run covers sizes and
# variants broadly, the GPU run is about compiled arithmetic (FMA contraction, division,
# subnormals, NaN handling, layouts of the big tiles).
COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
SEED_EDGES = (0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1)
FLT_MAX = torch.finfo(torch.float32).max


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Integer bit patterns of a float tensor (on CPU), every NaN made the same NaN."""
    t = t.detach().cpu()
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = bits_of(got), bits_of(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero().flatten()
        raise AssertionError(
            f"{what}: {bad.numel()} of {w.numel()} differ, first at {bad[:8].tolist()}: "
            f"got {got.detach().cpu()[bad[:8]].tolist()}, want {want.cpu()[bad[:8]].tolist()}"
        )


def assert_payload_equal(got: torch.Tensor, want: torch.Tensor, n: int, spec: QuantSpec) -> None:
    got = got.cpu()
    if torch.equal(got, want):
        return
    gc, gs = split_payload(got, n, spec)
    wc, ws = split_payload(want, n, spec)
    bad_c = (gc != wc).nonzero().flatten()[:8].tolist()
    bad_s = (gs.view(torch.int32) != ws.view(torch.int32)).nonzero().flatten()[:8].tolist()
    raise AssertionError(
        f"payload differs for n={n}, {spec}: code bytes {bad_c} "
        f"(got {gc[bad_c].tolist()}, want {wc[bad_c].tolist()}), scales {bad_s} "
        f"(got {gs[bad_s].tolist()}, want {ws[bad_s].tolist()})"
    )


# ---------------------------------------------------------------------------------------------
# strategies

# Mostly small blocks (many blocks per tile, cheap), rarely the large ones.
BLOCK_SIZES = st.sampled_from(
    [64, 4096] if COMPILED
    else [32] * 4 + [64] * 3 + [128] * 3 + [256] * 2 + [512, 1024, 2048, 4096]
)
SEEDS = st.one_of(st.sampled_from(SEED_EDGES), st.integers(0, 2**32 - 1),
                  st.integers(2**32, 2**64 - 1))
KINDS = ("normal", "zeros", "subnormal", "tiny", "huge", "constant", "mixed")


@st.composite
def specs_and_sizes(draw, max_n: int = 3000) -> tuple[QuantSpec, int]:
    bs = draw(BLOCK_SIZES)
    spec = QuantSpec(draw(st.sampled_from([1, 2, 4, 8])), bs,
                     draw(st.sampled_from(["nearest", "stochastic"])))
    if COMPILED:  # one size, so one divisibility pattern (the edge-size tests vary it)
        return spec, 4099
    n = draw(st.one_of(st.sampled_from([0, 1, bs - 1, bs, bs + 1, 2 * bs + 1]),
                       st.integers(0, max_n)))
    return spec, n


@st.composite
def float_values(draw, n: int, bs: int) -> torch.Tensor:
    """float32 [n] on CPU: one value regime, plus optional per-block outliers, NaN/Inf blocks
    and negative zeros. Bulk values come from a torch generator seeded by hypothesis."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(KINDS))
    if kind == "normal":
        x = torch.randn(n, generator=g) * 10.0 ** draw(st.integers(-4, 4))
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "subnormal":  # fp32 subnormals: scales become subnormal, the ulp bump fires
        x = torch.randn(n, generator=g) * 1e-40
    elif kind == "tiny":
        x = torch.randn(n, generator=g) * 1e-30
    elif kind == "huge":
        x = torch.randn(n, generator=g) * 1e30
    elif kind == "constant":
        x = torch.full((n,), draw(st.sampled_from([1.0, -2.5, 1e-30, -1e30, 3e-39, 1e-45,
                                                   FLT_MAX])))
    else:  # every block in its own decade, from subnormal to huge
        nb = num_blocks(n, QuantSpec(4, bs))
        decades = torch.randint(-44, 31, (nb,), generator=g).to(torch.float64)
        x = (torch.randn(n, generator=g, dtype=torch.float64)
             * (10.0 ** decades).repeat_interleave(bs)[:n]).to(torch.float32)
    nb = num_blocks(n, QuantSpec(4, bs))
    if n and draw(st.booleans()):  # one outlier per block
        pos = torch.arange(nb) * bs + torch.randint(0, bs, (nb,), generator=g)
        pos = pos[pos < n]
        x[pos] = draw(st.sampled_from([1e3, -1e3, 1e30, -3e38, FLT_MAX, -FLT_MAX]))
    if n and draw(st.integers(0, 3)) == 0:  # some non-finite blocks
        bad = torch.randint(0, n, (draw(st.integers(1, 3)),), generator=g)
        x[bad] = torch.tensor(draw(st.lists(st.sampled_from([float("nan"), float("inf"),
                                                             -float("inf")]),
                                            min_size=bad.numel(), max_size=bad.numel())))
    if n and draw(st.booleans()):
        x[torch.rand(n, generator=g) < 0.1] = -0.0
    return x


@st.composite
def quantize_cases(draw):
    spec, n = draw(specs_and_sizes())
    dtype = draw(st.sampled_from((torch.float32,) if COMPILED else DTYPES))
    x = draw(float_values(n, spec.block_size)).to(dtype)
    error_mode = draw(st.sampled_from(("in_out",) if COMPILED else ERROR_MODES))
    error_in = None
    if error_mode in ("in", "in_out", "alias"):
        error_in = draw(float_values(n, spec.block_size))
        if draw(st.booleans()):  # a residual much smaller than x, the usual case
            error_in = error_in * 1e-3
    return spec, x, error_mode, error_in, draw(SEEDS)


# ---------------------------------------------------------------------------------------------
# quantize


def run_quantize(spec: QuantSpec, x: torch.Tensor, error_mode: str,
                 error_in: torch.Tensor | None, seed: int, device: str) -> None:
    n = x.numel()
    nbytes = packed_nbytes(n, spec)
    want = torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage: every byte must be written
    got = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
    want_err = got_err = None
    if error_mode in ("out", "in_out"):
        want_err = torch.full((n,), 7.0)
        got_err = torch.full((n,), -7.0, device=device)
    elif error_mode == "alias":  # error_out is error_in: updated in place
        want_err = error_in.clone()
        got_err = error_in.clone().to(device)
    ein_ref = want_err if error_mode == "alias" else error_in
    ein_dev = got_err if error_mode == "alias" else (
        error_in.to(device) if error_in is not None else None)

    reference.quantize_into(x, spec, want, ein_ref, want_err, seed)
    triton_codec.quantize_into(x.to(device), spec, got, ein_dev, got_err, seed)

    assert_payload_equal(got, want, n, spec)
    if want_err is not None:
        assert_bits_equal(got_err, want_err, "error_out")


@settings(max_examples=500)
@given(case=quantize_cases())
@example(case=(QuantSpec(1, 4096, "nearest"), torch.randn(2 * 4096 + 1), "in_out",
          torch.randn(2 * 4096 + 1), 0))  # the full 12-level pairwise tree, three programs
@example(case=(QuantSpec(8, 32, "stochastic"), torch.randn(4097), "alias", torch.randn(4097),
          2**64 - 1))  # several programs, in-place residual
def test_quantize_matches_reference(case, device):
    run_quantize(*case, device=device)


def adversarial(n: int, seed: int) -> torch.Tensor:
    """float32 [n]: normal values with subnormals, zeros of both signs and huge outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    kinds = torch.randint(0, 8, (n,), generator=g)
    x = torch.where(kinds == 0, x * 1e-40, x)
    x = torch.where(kinds == 1, torch.zeros(n), x)
    x = torch.where(kinds == 2, torch.full((n,), -0.0), x)
    return torch.where(torch.rand(n, generator=g) < 0.01, x * 1e30, x)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "n", [1, 2048, 2049] if COMPILED else [0, 1, 31, 32, 33, 2047, 2048, 2049]
)
def test_quantize_edge_sizes(bits, rounding, n, device):
    """Every size edge against every code width, deterministically (also under the CI
    profile): empty, a single element, block +- 1, tile +- 1."""
    spec = QuantSpec(bits, 32, rounding)
    x = adversarial(n, n)
    run_quantize(spec, x, "in_out", x.flip(0) * 0.01, 2**40 + n, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_mode", ERROR_MODES)
def test_quantize_dtypes_and_residual_modes(dtype, error_mode, device):
    """Every input dtype with every residual wiring (none, in, out, both, in place)."""
    x = adversarial(1000, 1).to(dtype)
    error_in = adversarial(1000, 2) * 1e-3 if error_mode in ("in", "in_out", "alias") else None
    run_quantize(QuantSpec(4, 128, "stochastic"), x, error_mode, error_in, 2**64 - 2, device)


@pytest.mark.parametrize(
    ("bits", "sign", "seed"),
    # Seeds found with the reference before it clamped levels: each draws level +-(L + 1) for
    # some element, so the clamp to [-L, L] is exercised.
    [(8, -1, 52), (8, 1, 60), (4, -1, 199), (4, 1, 97)],
)
def test_level_clamp_matches_reference(bits, sign, seed, device):
    """absmax values whose ``absmax / scale`` rounds to just above L (1 + 29 ulp of 1.0 for
    8 bits, 1 + 6 ulp for 4 bits): stochastic rounding draws level +-(L + 1) with probability
    ~1e-6..1e-5 per element, which both backends must clamp to +-L identically."""
    spec = QuantSpec(bits, 256, "stochastic")
    a = torch.tensor(0x3F80001D if bits == 8 else 0x3F800006, dtype=torch.int32)
    x = torch.full((2048,), sign * float(a.view(torch.float32)))
    run_quantize(spec, x, "out", None, seed, device)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_flt_max_block_matches_reference(bits, device):
    """absmax == FLT_MAX: at 8 bits L * scale overflows and the scale is lowered one ulp."""
    x = adversarial(300, bits)
    x[5], x[77], x[200] = FLT_MAX, -FLT_MAX, FLT_MAX
    run_quantize(QuantSpec(bits, 64, "stochastic"), x, "in_out", x * 0, 7, device)
    run_quantize(QuantSpec(bits, 64), x, "out", None, 0, device)


def _around(x: float, ulps: int) -> torch.Tensor:
    """float32 [2 * ulps + 1]: x and its ``ulps`` float32 neighbours on each side."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    return (bits + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).view(torch.float32)


def two_bit_edges() -> torch.Tensor:
    """float32 [2048] (64 blocks of 32): values at and next to every decision point of the 2-bit
    code (grid positions k = 0.5, 1.5, 2.5: exact ties included, since fl(fl(2/3) * 1.5) = 1),
    at +-absmax, and blocks whose inner level fl(fl(1/3) s) rounds hard: s = 2**-149 (inner
    level 0), 2 * 2**-149 .. 7 * 2**-149, other subnormal and FLT_MAX scales."""
    tiny = 2.0**-149
    parts = []
    for s in (1.0, -3.0, 2.0**-126, 1e30, FLT_MAX):
        for point in (2 / 3, 0.0, -2 / 3):
            block = torch.cat([_around(point * s, 15) if point else
                               torch.tensor([0.0, -0.0] + [tiny * k for k in range(1, 30)]),
                               torch.tensor([s])])
            parts.append(block[:32])
    for s_units in (1, 2, 3, 4, 5, 6, 7, 1000):  # subnormal scales: v in multiples of 2**-149
        vals = torch.arange(-s_units, s_units + 1, dtype=torch.float64)[:31] * tiny
        parts.append(torch.cat([vals.to(torch.float32), torch.tensor([s_units * tiny])]))
    x = torch.cat([torch.nn.functional.pad(p, (0, 32 - p.numel())) for p in parts])
    return torch.nn.functional.pad(x, (0, 2048 - x.numel()))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_two_bit_grid_edges_match_reference(rounding, seed, device):
    """The 2-bit code at its decision points, ties, outer levels and hard scales: the same
    bytes and residuals on both backends, and the same decoded values."""
    x = two_bit_edges()
    spec = QuantSpec(2, 32, rounding)
    run_quantize(spec, x, "in_out", x.flip(0) * 0.0, seed, device)
    payload = torch.empty(packed_nbytes(x.numel(), spec), dtype=torch.uint8)
    reference.quantize_into(x, spec, payload, None, None, seed)
    got = torch.empty(x.numel(), device=device)
    triton_codec.dequantize_into(payload.to(device), spec, got)
    want = torch.empty(x.numel())
    reference.dequantize_into(payload, spec, want)
    assert_bits_equal(got, want, "dequantize of the 2-bit edge payload")


# log2 |v| of a 32-element block (None: 0) whose fp64 sum |v| ends within rounding of an fp32
# midpoint: the pairwise tree, the strided tree (a[j] + a[j + W/2]) and a left-to-right sum
# each give a different float32 mean (found by search), so a kernel summing in another order
# fails here even though random data almost never shows it.
ORDER_SENSITIVE_BLOCK = [-50, 4, -49, -50, 0, -49, 0, -50, None, -50, -19, -50, -50, -50, -50, -50,
                         4, -50, -50, -50, -49, -50, -50, -19, -49, -50, 0, -50, 4, -50, 4, None]


@pytest.mark.parametrize("rows", [1, 70])
def test_one_bit_sum_order_matches_reference(rows, device):
    """1-bit scales: the fixed pairwise fp64 tree, in one block and across programs."""
    mags = torch.tensor([0.0 if e is None else 2.0**e for e in ORDER_SENSITIVE_BLOCK])
    signs = torch.where(torch.rand(32 * rows, generator=torch.Generator().manual_seed(rows))
                        < 0.5, -1.0, 1.0)
    x = mags.repeat(rows) * signs
    run_quantize(QuantSpec(1, 32), x, "out", None, 0, device)


def test_nan_scale_bytes_are_canonical(device):
    """A non-finite block's scale is the exact bytes of float('nan') (0x7FC00000), its codes
    are zero, and the other blocks are untouched by it."""
    spec = QuantSpec(4, 32)
    x = torch.randn(96)
    x[40] = float("nan")
    x[70] = -float("inf")
    got = torch.empty(packed_nbytes(96, spec), dtype=torch.uint8, device=device)
    triton_codec.quantize_into(x.to(device), spec, got, None, None, 0)
    codes, scales = split_payload(got.cpu(), 96, spec)
    assert scales.view(torch.int32).tolist()[1:] == [0x7FC00000, 0x7FC00000]
    assert torch.isfinite(scales[0])
    assert codes[16:48].eq(0).all()


# ---------------------------------------------------------------------------------------------
# dequantize and dequant_accumulate (payloads made by the reference, non-finite ones included)


@st.composite
def payload_cases(draw, max_k: int = 1):
    spec, n = draw(specs_and_sizes())
    k = draw(st.integers(1, max_k))
    seed = draw(SEEDS)
    payloads = torch.empty(k, packed_nbytes(n, spec), dtype=torch.uint8)
    for i in range(k):
        reference.quantize_into(draw(float_values(n, spec.block_size)), spec, payloads[i],
                                None, None, seed + i if seed + i < 2**64 else seed - i)
    return spec, n, payloads


@settings(max_examples=150)
@given(case=payload_cases())
def test_dequantize_matches_reference(case, device):
    spec, n, payloads = case
    for dtype in (torch.float32,) if COMPILED else DTYPES:
        want = torch.empty(n, dtype=dtype)
        got = torch.full((n,), 3.0, dtype=dtype, device=device)
        reference.dequantize_into(payloads[0], spec, want)
        triton_codec.dequantize_into(payloads[0].to(device), spec, got)
        assert_bits_equal(got, want, f"dequantize to {dtype}")


@settings(max_examples=150)
@given(case=payload_cases(max_k=4), weighted=st.booleans(),
       gen_seed=st.integers(0, 2**31 - 1))
def test_dequant_accumulate_matches_reference(case, weighted, gen_seed, device):
    spec, n, payloads = case
    g = torch.Generator().manual_seed(gen_seed)
    k = payloads.shape[0]
    weights = None
    if weighted:
        weights = torch.randn(k, generator=g)
        weights[torch.rand(k, generator=g) < 0.2] = 1 / 3  # a weight no power of two
    want = torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-3, 4, (), generator=g))
    got = want.to(device, copy=True)  # a copy on the CPU too: not the tensor the oracle writes
    reference.dequant_accumulate_into(payloads, spec, want, weights)
    triton_codec.dequant_accumulate_into(payloads.to(device), spec, got,
                                         weights.to(device) if weighted else None)
    assert_bits_equal(got, want, f"dequant_accumulate K={k} weighted={weighted}")


# On a GPU one case, whose binaries the property tests above have built already.
@pytest.mark.parametrize(("bits", "block_size"), [(4, 4096)] if COMPILED else [
    (bits, bs) for bits in (1, 2, 4, 8) for bs in (1024, 2048, 4096)])
def test_blocks_wider_than_a_decode_row_match_reference(bits, block_size, device):
    """A block wider than the decoding kernels' row (512 values) is decoded as several rows
    sharing its scale: every row takes its own block's scale, up to a last block cut short,
    in dequantize and in a weighted dequantize-accumulate of three payloads."""
    spec = QuantSpec(bits, block_size, "stochastic")
    n = 2 * block_size + 700  # three blocks, the last one partial
    payloads = torch.empty(3, packed_nbytes(n, spec), dtype=torch.uint8)
    for i in range(3):  # blocks of very different scales, so a wrong scale shows
        x = adversarial(n, 60 + i) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(
            block_size)[:n]
        reference.quantize_into(x, spec, payloads[i], None, None, 7 + i)
    want = torch.empty(n)
    got = torch.full((n,), 3.0, device=device)
    reference.dequantize_into(payloads[1], spec, want)
    triton_codec.dequantize_into(payloads[1].to(device), spec, got)
    assert_bits_equal(got, want, "dequantize")
    weights = torch.tensor([0.5, -1.0, 1 / 3])
    want = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    got = want.to(device, copy=True)
    reference.dequant_accumulate_into(payloads, spec, want, weights)
    triton_codec.dequant_accumulate_into(payloads.to(device), spec, got, weights.to(device))
    assert_bits_equal(got, want, "dequant_accumulate")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_out_dtypes(dtype, device):
    """Rounding into fp16/bf16 outputs (round to nearest even, overflow to Inf), NaN blocks."""
    spec = QuantSpec(8, 64)
    x = adversarial(1000, 3) * 1e5  # decoded values beyond fp16's range too
    x[100] = float("nan")
    payload = torch.empty(packed_nbytes(1000, spec), dtype=torch.uint8)
    reference.quantize_into(x, spec, payload, None, None, 0)
    want = torch.empty(1000, dtype=dtype)
    got = torch.empty(1000, dtype=dtype, device=device)
    reference.dequantize_into(payload, spec, want)
    triton_codec.dequantize_into(payload.to(device), spec, got)
    assert_bits_equal(got, want, f"dequantize to {dtype}")


# ---------------------------------------------------------------------------------------------
# the in-kernel counter hash


@pytest.mark.parametrize("seed", (*SEED_EDGES, 0x0123456789ABCDEF))
@pytest.mark.parametrize(
    "start", [0, 2**31 - 1024, 2**32 - 1024, 2**32, 7 * 2**32 + 4096, 2**40, 2**62]
)
def test_uniform_stream_matches_counter_hash(seed, start, device):
    """The kernel's random stream equals counter_hash.uniform bit for bit, including index
    ranges above 2**32 and ranges that cross a 2**32 boundary (a new key per program)."""
    count = 3000
    got = triton_codec._uniform_stream(seed, start, count, device)
    want = counter_hash.uniform(seed, start, count)
    assert_bits_equal(got, want, f"uniform(seed={seed}, start={start})")


# ---------------------------------------------------------------------------------------------
# through the public API


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [(QuantSpec(1, 64), torch.float32), (QuantSpec(4, 128, "stochastic"), torch.bfloat16),
     (QuantSpec(8, 32, "stochastic"), torch.float16), (QuantSpec(2, 256), torch.float32)],
)
def test_compress_backend_triton_matches_reference(spec, dtype, device, monkeypatch):
    """compress.quantize / dequantize / dequant_accumulate with QCOMM_BACKEND=triton on device
    equal the reference backend on CPU, error feedback state included."""
    g = torch.Generator().manual_seed(spec.bits * 1000 + spec.block_size)
    x = (torch.randn(5, 301, generator=g) * 4).to(dtype)
    err = torch.randn(5 * 301, generator=g) * 0.01

    def run(backend: str, dev: str):
        monkeypatch.setenv("QCOMM_BACKEND", backend)
        e = err.clone().to(dev)
        packed = compress.quantize(x.to(dev), spec, error=e, seed=2**63 + 5)
        deq = compress.dequantize(packed)
        acc = torch.ones(x.numel(), device=dev)
        payloads = torch.stack([packed.payload, packed.payload])
        compress.dequant_accumulate(payloads, acc, spec, weights=[0.5, -0.25])
        return packed.payload.cpu(), e.cpu(), deq.cpu(), acc.cpu()

    want = run("reference", "cpu")
    got = run("triton", device)
    assert torch.equal(got[0], want[0])
    for g_, w_, what in zip(got[1:], want[1:], ["error", "dequantize", "dequant_accumulate"],
                            strict=True):
        assert_bits_equal(g_, w_, what)


def test_compress_triton_overflow_leaves_out_unchanged(device, monkeypatch):
    """dequant_accumulate's overflow check holds on the Triton backend too: the trial sum runs
    on a copy of out, and out keeps its bits."""
    monkeypatch.setenv("QCOMM_BACKEND", "triton")
    spec = QuantSpec(4, 64)
    big = compress.quantize(torch.full((300,), FLT_MAX / 1.5, device=device), spec).payload
    out = torch.randn(300, device=device)
    before = out.clone()
    with pytest.raises(compress.AccumulateOverflowError):
        compress.dequant_accumulate(torch.stack([big, big]), out, spec)
    assert_bits_equal(out, before, "out after the refused accumulate")
    compress.dequant_accumulate(torch.stack([big, big]), out, spec, weights=[0.5, 0.25])
    assert bool(torch.isfinite(out).all())


def test_compress_triton_nonfinite_leaves_error_unchanged(device, monkeypatch):
    monkeypatch.setenv("QCOMM_BACKEND", "triton")
    x = torch.randn(300, device=device)
    x[200] = float("inf")
    err = torch.randn(300, device=device)
    before = err.clone()
    with pytest.raises(compress.NonFiniteError) as info:
        compress.quantize(x, QuantSpec(4, 64), error=err)
    assert info.value.blocks == [3]
    assert torch.equal(err, before)


def _guard(scale_max: list[float], device) -> AccumulateGuard:
    return AccumulateGuard(torch.tensor(scale_max, dtype=torch.float32, device=device),
                           torch.empty((), dtype=torch.bool, device=device))


@pytest.mark.parametrize("bits", [4] if COMPILED else [1, 2, 4, 8])  # one binary on a GPU
def test_dequant_accumulate_guard(bits, device):
    """The guarded kernel gives the unguarded kernel's bits and the verdict True when the
    payloads' largest scales pass the rule; when they fail it (a NaN scale, or finite scales
    whose bound passes float32's range) it leaves out bit for bit as it was, even over payloads
    a real pass would turn into NaN, and records False. The reference agrees on each verdict."""
    spec = QuantSpec(bits, 64)
    n = 700
    payloads = torch.empty(3, packed_nbytes(n, spec), dtype=torch.uint8)
    for i in range(3):
        reference.quantize_into(adversarial(n, 40 + i), spec, payloads[i], None, None, i)
    weights = torch.tensor([0.5, -1.0, 1 / 3])
    start = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    want = start.to(device, copy=True)
    triton_codec.dequant_accumulate_into(payloads.to(device), spec, want, weights.to(device))
    healthy = torch.linalg.vector_norm(split_payload(payloads, n, spec)[1], float("inf"), dim=-1)
    got, guard = start.to(device, copy=True), _guard(healthy.tolist(), device)
    triton_codec.dequant_accumulate_into(payloads.to(device), spec, got, weights.to(device),
                                         guard)
    assert_bits_equal(got, want, "guard passed")
    assert bool(guard.verdict)
    split_payload(payloads, n, spec)[1][1, 3] = float("nan")
    for scale_max in ([healthy[0].item(), float("nan"), healthy[2].item()],
                      [healthy[0].item(), FLT_MAX, FLT_MAX / 2]):  # 1.17 FLT_MAX in all
        kept, guard = start.to(device, copy=True), _guard(scale_max, device)
        triton_codec.dequant_accumulate_into(payloads.to(device), spec, kept,
                                             weights.to(device), guard)
        assert_bits_equal(kept, start, f"guard failed for {scale_max}")
        assert not bool(guard.verdict)
        ref_guard = _guard(scale_max, "cpu")
        reference.dequant_accumulate_into(payloads, spec, start.clone(), weights, ref_guard)
        assert not bool(ref_guard.verdict)


def _largest_allowed(w: list[float], factor: float) -> float:
    """The largest float32 s with guard_total([s, s], w) * factor <= FLT_MAX (float64)."""
    up, down = torch.tensor(FLT_MAX), torch.tensor(0.0)
    s = torch.tensor(FLT_MAX / factor / sum(w), dtype=torch.float32)
    while guard_total([s.item()] * 2, w) * factor > FLT_MAX:
        s = torch.nextafter(s, down)
    while guard_total([torch.nextafter(s, up).item()] * 2, w) * factor <= FLT_MAX:
        s = torch.nextafter(s, up)
    return s.item()


@pytest.mark.parametrize("weighted", [False, True])
def test_dequant_accumulate_guard_verdict_at_the_rule_edge(weighted, device):
    """At the largest scale the rule allows, and at the next float32 above it, the kernel's
    verdict (computed on the device, in float64, beside its sum) is the reference's and the
    rule's: True and the sum written, then False and out unchanged. A weight of 0 against an
    Inf scale (0 * Inf is NaN) fails it too."""
    spec = QuantSpec(4, 64)
    n = 130
    payloads = torch.empty(2, packed_nbytes(n, spec), dtype=torch.uint8)
    for i in range(2):  # real scales of 1: the sum is small whatever the guard is told
        reference.quantize_into(torch.ones(n), spec, payloads[i], None, None, 0)
    w = [0.75, -0.5] if weighted else None
    s = _largest_allowed([abs(v) for v in w] if w else [1.0, 1.0], slack_factor(4, 2))
    above = torch.nextafter(torch.tensor(s), torch.tensor(FLT_MAX)).item()
    cases = [([s, s], w, True), ([above, above], w, False)]
    if weighted:
        cases.append(([1.0, float("inf")], [0.75, 0.0], False))
    for scale_max, weights, allowed in cases:
        for backend, dev in ((triton_codec, device), (reference, "cpu")):
            out, guard = torch.zeros(n, device=dev), _guard(scale_max, dev)
            backend.dequant_accumulate_into(
                payloads.to(dev), spec, out,
                None if weights is None else torch.tensor(weights, device=dev), guard)
            what = f"{backend.__name__} for scale_max={scale_max}, weights={weights}"
            assert bool(guard.verdict) is allowed, what
            assert bool((out != 0).all()) is allowed, what


def test_compress_triton_non_blocking_matches_blocking(device, monkeypatch):
    """The non-blocking public calls on the Triton backend: the blocking bits when the input is
    healthy; on NaN, the residual and out kept and the error raised by wait()."""
    monkeypatch.setenv("QCOMM_BACKEND", "triton")
    spec = QuantSpec(2, 64, "stochastic")
    x = torch.randn(300, generator=torch.Generator().manual_seed(3)).to(device)
    err = (torch.randn(300, generator=torch.Generator().manual_seed(4)) * 0.1).to(device)
    want_err, got_err = err.clone(), err.clone()
    want = compress.quantize(x, spec, error=want_err, seed=9)
    got = compress.quantize(x, spec, error=got_err, seed=9, non_blocking=True).wait()
    assert torch.equal(got.payload, want.payload)
    assert_bits_equal(got_err, want_err, "residual")
    payloads = torch.stack([want.payload, got.payload])
    acc_want, acc_got = torch.ones(300, device=device), torch.ones(300, device=device)
    compress.dequant_accumulate(payloads, acc_want, spec, [0.5, 0.25])
    compress.dequant_accumulate(payloads, acc_got, spec, [0.5, 0.25], non_blocking=True).wait()
    assert_bits_equal(acc_got, acc_want, "dequant_accumulate")
    bad = x.clone()
    bad[70] = float("nan")
    before = got_err.clone()
    pending = compress.quantize(bad, spec, error=got_err, seed=10, non_blocking=True)
    check = compress.dequant_accumulate(torch.stack([pending.payload]), acc_got, spec,
                                        non_blocking=True)
    with pytest.raises(compress.NonFiniteError) as info:
        pending.wait()
    assert info.value.blocks == [1]
    with pytest.raises(compress.NonFiniteError):
        check.wait()
    assert_bits_equal(got_err, before, "residual after a NaN input")
    assert_bits_equal(acc_got, acc_want, "out after a NaN payload")
