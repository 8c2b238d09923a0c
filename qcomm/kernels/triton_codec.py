"""Fused Triton codec: the CUDA backend of :mod:`qcomm.compress`, bit for bit equal to
:mod:`qcomm.kernels.reference`.

Three kernels, one per operation, each parameterized by constexprs instead of copied per variant:

* ``_quantize_kernel``: reads x (fp32/fp16/bf16) and the optional residual once, writes the
  packed codes, the block scales and the new residual once (error feedback in one pass).
* ``_dequantize_kernel``: reads a payload once, writes fp32/fp16/bf16 values once.
* ``_dequant_accumulate_kernel``: reads its slice of ``out`` once, decodes the K payloads one
  after the other in registers (``acc = acc + d * w``), writes ``out`` once.

Each program owns ``ROWS`` whole quantization blocks as a ``[ROWS, BLOCK_SIZE]`` tile
(``ROWS * BLOCK_SIZE`` = :data:`TILE_ELEMS` or one block if larger), so block reductions are
reductions along axis 1 and never cross programs.

Bit-exactness with the CPU reference rests on a few rules, each applied below where it matters:

* Every kernel is launched with ``enable_fp_fusion=False``: the reference rounds ``q * scale``
  before subtracting it, an FMA would not.
* fp32 divisions use ``tl.math.div_rn`` (IEEE round to nearest); plain ``/`` is approximate
  on CUDA. The 1-bit mean divides in fp64, where ``/`` is IEEE already.
* Rounding to an integer is ``(t + 1.5 * 2**23) - 1.5 * 2**23``, and floor is derived from it
  (no libdevice call, whose flush-to-zero reflection could differ from the CPU on subnormals).
* bfloat16 conversions are done on the bits (exact widening, round-to-nearest-even narrowing,
  NaN -> 0x7FC0 like torch), because Triton's interpreter truncates and mishandles subnormals
  when it converts fp32 <-> bf16 itself.
* The 1-bit mean sums in fp64 in the fixed pairwise tree of
  :func:`qcomm.kernels.reference.pairwise_sum_f64`.
* Element indices are int64 (``pid.to(tl.int64)`` times the tile): tensors past 2**31 elements
  work; per-element offsets inside a tile stay int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qcomm.kernels.wire_format import (
    INPUT_DTYPES,
    QuantSpec,
    codes_nbytes,
    num_blocks,
    packed_nbytes,
)
from qcomm.validation import check_seed

__all__ = ["dequant_accumulate_into", "dequantize_into", "quantize_into"]

# Elements per program. 2048 fp32 values are 16 per thread at 4 warps: enough bytes in flight
# per SM for a memory-bound kernel without spilling the [ROWS, BLOCK_SIZE] tile.
TILE_ELEMS = 2048
# 2**23 + 2**22: adding then subtracting it rounds |t| < 2**22 to the nearest integer, ties to
# even (same constant as reference.ROUND_MAGIC).
_ROUND_MAGIC = tl.constexpr(12582912.0)
# fl(1/3) = 0x3EAAAAAB, the inner level of the 2-bit code (same as reference.ONE_THIRD).
_ONE_THIRD = tl.constexpr(0.3333333432674408)
# Quiet NaN bit pattern torch writes for float("nan"); the scale of a non-finite block must be
# these exact bytes on every device.
_NAN_F32_BITS = tl.constexpr(0x7FC00000)
# Element count of one program of the test-only hash kernel (its start must be a multiple).
_HASH_TILE = 1024


# ---------------------------------------------------------------------------------------------
# shared @triton.jit helpers


@triton.jit
def _mix32(h):
    """lowbias32 on uint32 (products wrap mod 2**32, as counter_hash.mix32 emulates)."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit
def _tile_uniform(base, local, seed_lo, seed_hi):
    """counter_hash.uniform for element indices ``base + local``: ``base`` int64, a multiple of
    the tile (so the tile never straddles a 2**32 boundary and the key of the index's top half
    is computed once per program); ``local`` int32 in [0, tile). Returns float32 in [0, 1).
    The quantize kernel and the test hook ``_uniform_kernel`` both call exactly this."""
    key = _mix32(((base >> 32).to(tl.uint32)) ^ 0x9E3779B9)
    key = _mix32(seed_hi.to(tl.uint32) ^ key)
    key = _mix32(seed_lo.to(tl.uint32) ^ key)
    lo = base.to(tl.uint32) + local.to(tl.uint32)  # no carry: base % 2**32 + local < 2**32
    bits = _mix32(_mix32(lo ^ key) + key)
    # 24 random bits convert exactly; times 2**-24 is exact too.
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _bf16_bits_to_f32(raw):
    """int16 bit patterns of bfloat16 -> float32 (exact widening)."""
    return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x):
    """float32 -> int16 bit patterns of bfloat16, round to nearest even; NaN -> 0x7FC0 (torch)."""
    b = x.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _two_bit_level(codes):
    """float32 levels -1, -fl(1/3), fl(1/3), 1 of 2-bit codes 0..3 (int or float; the product
    of +-1 and 1 or fl(1/3) is exact)."""
    sign = tl.where(codes >= 2, 1.0, -1.0)
    return sign * tl.where((codes == 0) | (codes == 3), 1.0, _ONE_THIRD)


@triton.jit
def _decode_tile(codes_ptr, scales_ptr, byte_limit, block_limit,
                 BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    """Decode one tile: ``codes_ptr`` / ``scales_ptr`` already point at the program's first
    byte / scale; ``byte_limit`` / ``block_limit`` are how many of them remain in the payload.
    Returns float32 ``[ROWS, BLOCK_SIZE]`` = level * scale (one rounding, as the reference)."""
    PER: tl.constexpr = 8 // BITS
    ROW_BYTES: tl.constexpr = BLOCK_SIZE // PER
    r = tl.arange(0, ROWS)
    byte = r[:, None] * ROW_BYTES + tl.arange(0, ROW_BYTES)[None, :]
    raw = tl.load(codes_ptr + byte, mask=byte < byte_limit, other=0).to(tl.int32)
    if PER == 1:
        codes = raw
    else:
        # element 0 of a byte sits in its low bits
        shifts = tl.arange(0, PER) * BITS
        codes = (raw[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(codes, [ROWS, BLOCK_SIZE])
    if BITS == 1:
        q = (codes * 2 - 1).to(tl.float32)
    elif BITS == 2:
        q = _two_bit_level(codes)
    else:
        q = (codes - ((1 << (BITS - 1)) - 1)).to(tl.float32)
    scale = tl.load(scales_ptr + r, mask=r < block_limit, other=0.0)
    return q * scale[:, None]


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _quantize_kernel(
    x_ptr, err_in_ptr, err_out_ptr, codes_ptr, scales_ptr,
    n, nblocks, n_code_bytes, seed_lo, seed_hi,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
    STOCHASTIC: tl.constexpr, HAS_ERROR_IN: tl.constexpr, HAS_ERROR_OUT: tl.constexpr,
    X_BF16: tl.constexpr,
):
    TILE: tl.constexpr = ROWS * BLOCK_SIZE
    PER: tl.constexpr = 8 // BITS
    ROW_BYTES: tl.constexpr = BLOCK_SIZE // PER
    LEVEL: tl.constexpr = (1 << (BITS - 1)) - 1

    pid = tl.program_id(0).to(tl.int64)
    base = pid * TILE  # first element of the tile, int64
    remaining = n - base  # elements of x from this tile on (may exceed TILE)
    r = tl.arange(0, ROWS)
    local = r[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]  # int32 [ROWS, B]
    real = local < remaining

    if X_BF16:
        v = _bf16_bits_to_f32(tl.load(x_ptr + base + local, mask=real, other=0))
    else:
        v = tl.load(x_ptr + base + local, mask=real, other=0.0).to(tl.float32)
    if HAS_ERROR_IN:
        v = v + tl.load(err_in_ptr + base + local, mask=real, other=0.0)

    # Count NaN/Inf per block explicitly: tl.max does not propagate NaN on every backend.
    bad = ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
    finite = tl.sum(bad, axis=1) == 0  # [ROWS]
    valid = real & finite[:, None]

    if BITS == 1:
        # Mean |v| summed in fp64 in the reference's fixed pairwise tree: level by level,
        # element j of the next level is a[2j] + a[2j+1]. Padding elements are 0.
        # A sum over an axis of 2 is that one addition (fp addition commutes, so the order
        # inside a pair is irrelevant). It compiles better than tl.split of the same reshape:
        # for sm_90 at BLOCK_SIZE 4096, 58 registers instead of 255 plus spills.
        a = tl.abs(v).to(tl.float64)
        for lvl in tl.static_range(12):  # 2**12 = MAX_BLOCK_SIZE
            if (BLOCK_SIZE >> lvl) > 1:
                a = tl.sum(tl.reshape(a, [ROWS, BLOCK_SIZE >> (lvl + 1), 2]), axis=2)
        total = tl.reshape(a, [ROWS])
        count = tl.minimum(remaining - r * BLOCK_SIZE, BLOCK_SIZE)
        count = tl.maximum(count, 1).to(tl.float64)  # rows past the end: any nonzero divisor
        # fp64 `/` is IEEE round-to-nearest on CUDA (div.rn.f64); tl.math.div_rn and
        # fdiv(ieee_rounding=True) are fp32-only in the NVIDIA backend.
        scale = (total / count).to(tl.float32)
        positive = v >= 0
        codes = (positive & valid).to(tl.int32)
        # The residual uses the unmarked scale (+-Inf or NaN in bad blocks), as the reference.
        decoded = tl.where(positive, scale[:, None], -scale[:, None])
    elif BITS == 2:
        # Four levels {-1, -1/3, 1/3, 1} * absmax (wire format, "The 2-bit code"): the scale is
        # absmax itself, k = fl(fl(t * 1.5) + 1.5) is the grid position in [0, 3] (exactly, so
        # no clamp). Non-finite blocks get the NaN scale before decoding, as the reference.
        scale = tl.where(finite, tl.max(tl.abs(v), axis=1), float("nan"))
        s = scale[:, None]
        t = tl.where(s == 0, 0.0, tl.math.div_rn(v, tl.where(s == 0, 1.0, s)))
        k = t * 1.5 + 1.5  # two roundings: fusion is off
        q = (k + _ROUND_MAGIC) - _ROUND_MAGIC
        if STOCHASTIC:
            fl = tl.where(q > k, q - 1.0, q)  # floor(k), k >= 0
            rnd = _tile_uniform(base, local, seed_lo, seed_hi)
            q = fl + (rnd < (k - fl)).to(tl.float32)
        codes = tl.where(valid, q, 0.0).to(tl.int32)
        decoded = _two_bit_level(q) * s
    else:
        levels = tl.full([ROWS], LEVEL, tl.float32)
        absmax = tl.max(tl.abs(v), axis=1)
        scale = tl.math.div_rn(absmax, levels)
        # One ulp up where rounding made scale * L < absmax (the top level must reach absmax;
        # mostly subnormal scales), then one ulp down where L * scale overflows (absmax ==
        # FLT_MAX at L = 127): the decoded top level must stay finite.
        bumped = (scale.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
        scale = tl.where(scale * levels < absmax, bumped, scale)
        lowered = (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        scale = tl.where((tl.abs(scale * levels) == float("inf")) & (absmax == absmax)
                         & (absmax != float("inf")), lowered, scale)
        # The reference's scale of a NaN block is NaN (torch's amax propagates it) and of an
        # Inf block is Inf; both decode every element to NaN, and so does a NaN scale here.
        scale = tl.where(finite, scale, float("nan"))
        s = scale[:, None]
        t = tl.where(s == 0, 0.0, tl.math.div_rn(v, tl.where(s == 0, 1.0, s)))
        nearest = (t + _ROUND_MAGIC) - _ROUND_MAGIC
        if STOCHASTIC:
            # floor(t) from the nearest integer: equal to torch.floor for |t| <= L except
            # -0 -> +0, which leaves q unchanged (fl + 0 is +0 either way).
            fl = tl.where(nearest > t, nearest - 1.0, nearest)
            rnd = _tile_uniform(base, local, seed_lo, seed_hi)  # TILE divides 2**32
            q = fl + (rnd < (t - fl)).to(tl.float32)
        else:
            q = nearest
        # fl(v / scale) can exceed L by an ulp: clamp to [-L, L] (with where, not
        # minimum/maximum, whose NaN handling differs between backends; NaN stays NaN).
        q = tl.where(q > LEVEL, LEVEL, tl.where(q < -LEVEL, -LEVEL, q))
        codes = tl.where(valid, q + LEVEL, 0.0).to(tl.int32)
        decoded = q * s

    if HAS_ERROR_OUT:
        tl.store(err_out_ptr + base + local, v - decoded, mask=real)

    nan = tl.full([ROWS], _NAN_F32_BITS, tl.int32).to(tl.float32, bitcast=True)
    block_base = pid * ROWS
    tl.store(scales_ptr + block_base + r, tl.where(finite, scale, nan),
             mask=r < nblocks - block_base)

    if PER == 1:
        packed = codes
    else:
        shifts = tl.arange(0, PER) * BITS
        grouped = tl.reshape(codes, [ROWS, ROW_BYTES, PER]) << shifts[None, None, :]
        packed = tl.sum(grouped, axis=2)  # disjoint bit fields: the sum is their OR
    byte_base = pid * (ROWS * ROW_BYTES)
    byte = r[:, None] * ROW_BYTES + tl.arange(0, ROW_BYTES)[None, :]
    # Codes of padding elements are 0, so the alignment bytes up to n_code_bytes come out 0.
    tl.store(codes_ptr + byte_base + byte, packed.to(tl.uint8),
             mask=byte < n_code_bytes - byte_base)


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, n, nblocks, n_code_bytes,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr,
):
    TILE: tl.constexpr = ROWS * BLOCK_SIZE
    ROW_BYTES: tl.constexpr = BLOCK_SIZE * BITS // 8
    pid = tl.program_id(0).to(tl.int64)
    base = pid * TILE
    byte_base = pid * (ROWS * ROW_BYTES)
    block_base = pid * ROWS
    d = _decode_tile(codes_ptr + byte_base, scales_ptr + block_base,
                     n_code_bytes - byte_base, nblocks - block_base, BITS, BLOCK_SIZE, ROWS)
    local = tl.arange(0, ROWS)[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    real = local < n - base
    if OUT_BF16:
        tl.store(out_ptr + base + local, _f32_to_bf16_bits(d), mask=real)
    else:
        tl.store(out_ptr + base + local, d.to(out_ptr.dtype.element_ty), mask=real)


@triton.jit(do_not_specialize=["K"])  # K == 1 needs no variant of its own
def _dequant_accumulate_kernel(
    payloads_ptr, scales_ptr, out_ptr, w_ptr, n, nblocks, n_code_bytes, K,
    payload_stride, scale_stride,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    TILE: tl.constexpr = ROWS * BLOCK_SIZE
    ROW_BYTES: tl.constexpr = BLOCK_SIZE * BITS // 8
    pid = tl.program_id(0).to(tl.int64)
    base = pid * TILE
    byte_base = pid * (ROWS * ROW_BYTES)
    block_base = pid * ROWS
    local = tl.arange(0, ROWS)[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    real = local < n - base
    acc = tl.load(out_ptr + base + local, mask=real, other=0.0)
    # Walk the K payloads by pointer increments (64-bit addresses; k * stride never overflows).
    p_codes = payloads_ptr + byte_base
    p_scales = scales_ptr + block_base
    p_w = w_ptr
    for _ in range(K):
        d = _decode_tile(p_codes, p_scales, n_code_bytes - byte_base, nblocks - block_base,
                         BITS, BLOCK_SIZE, ROWS)
        if HAS_WEIGHTS:
            d = d * tl.load(p_w)  # rounded product, then a rounded sum: no FMA (fusion is off)
            p_w += 1
        acc = acc + d
        p_codes += payload_stride
        p_scales += scale_stride
    tl.store(out_ptr + base + local, acc, mask=real)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _uniform_kernel(out_ptr, start, count, seed_lo, seed_hi, TILE: tl.constexpr):
    """Test hook: the quantize kernel's random stream for indices start .. start+count-1."""
    pid = tl.program_id(0).to(tl.int64)
    base = start + pid * TILE  # a multiple of TILE, as in quantize
    local = tl.arange(0, TILE)
    rnd = _tile_uniform(base, local, seed_lo, seed_hi)
    tl.store(out_ptr + pid * TILE + local, rnd, mask=local < count - pid * TILE)


# ---------------------------------------------------------------------------------------------
# launchers: checks, grid, launch


def _seed_halves(seed: int) -> tuple[int, int]:
    """The two 32-bit halves of a seed as *signed* int32 values (the kernel reads them back as
    uint32): Triton types an int argument by its value, so unsigned halves >= 2**31 would
    compile a second (int64) variant of every kernel."""

    def signed(h: int) -> int:
        return h - (1 << 32) if h >= 1 << 31 else h

    return signed(seed & 0xFFFFFFFF), signed(seed >> 32)


def _rows(spec: QuantSpec) -> int:
    """Blocks per program: TILE_ELEMS // block_size, at least one block."""
    return max(1, TILE_ELEMS // spec.block_size)


def _num_warps(spec: QuantSpec) -> int:
    return 8 if _rows(spec) * spec.block_size >= 4096 else 4


def _check_tensor(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], numel: int,
                  device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {t.dtype}")
    if t.numel() != numel or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous with {numel} elements, got "
                         f"{t.numel()} (contiguous={t.is_contiguous()})")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _scales_view(payload: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """float32 view of the scales section of uint8 ``[..., nbytes]`` (4-byte aligned)."""
    return payload[..., codes_nbytes(n, spec):].view(torch.float32)


def _launch_quantize(x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                     error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                     seed: int) -> None:
    n = x.numel()
    _check_tensor(x, "x", INPUT_DTYPES, n, x.device)
    _check_tensor(payload, "payload", (torch.uint8,), packed_nbytes(n, spec), x.device)
    if error_in is not None:
        _check_tensor(error_in, "error_in", (torch.float32,), n, x.device)
    if error_out is not None:
        _check_tensor(error_out, "error_out", (torch.float32,), n, x.device)
    seed = check_seed(seed) if spec.rounding == "stochastic" else 0
    if n == 0:
        return
    rows = _rows(spec)
    nb = num_blocks(n, spec)
    grid = (triton.cdiv(nb, rows),)
    _quantize_kernel[grid](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        error_in, error_out, payload, _scales_view(payload, n, spec),
        n, nb, codes_nbytes(n, spec), *_seed_halves(seed),
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        # 1-bit codes ignore the rounding mode: one compiled variant, not two
        STOCHASTIC=spec.rounding == "stochastic" and spec.bits > 1,
        HAS_ERROR_IN=error_in is not None, HAS_ERROR_OUT=error_out is not None,
        X_BF16=x.dtype == torch.bfloat16,
        num_warps=_num_warps(spec), enable_fp_fusion=False,
    )


def _launch_dequantize(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    n = out.numel()
    _check_tensor(out, "out", INPUT_DTYPES, n, out.device)
    _check_tensor(payload, "payload", (torch.uint8,), packed_nbytes(n, spec), out.device)
    if n == 0:
        return
    rows = _rows(spec)
    nb = num_blocks(n, spec)
    grid = (triton.cdiv(nb, rows),)
    _dequantize_kernel[grid](
        payload, _scales_view(payload, n, spec),
        out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
        n, nb, codes_nbytes(n, spec),
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=_num_warps(spec), enable_fp_fusion=False,
    )


def _launch_dequant_accumulate(payloads: torch.Tensor, spec: QuantSpec, out: torch.Tensor,
                               weights: torch.Tensor | None) -> None:
    n = out.numel()
    _check_tensor(out, "out", (torch.float32,), n, out.device)
    nbytes = packed_nbytes(n, spec)
    if not isinstance(payloads, torch.Tensor) or payloads.dim() != 2:
        raise ValueError("payloads must be a uint8 tensor of shape [K, nbytes]")
    k = payloads.shape[0]
    _check_tensor(payloads, "payloads", (torch.uint8,), k * nbytes, out.device)
    if payloads.shape[1] != nbytes:
        raise ValueError(f"payloads must have shape [K, {nbytes}], got {tuple(payloads.shape)}")
    if weights is not None:
        _check_tensor(weights, "weights", (torch.float32,), k, out.device)
    if n == 0 or k == 0:
        return
    rows = _rows(spec)
    nb = num_blocks(n, spec)
    grid = (triton.cdiv(nb, rows),)
    _dequant_accumulate_kernel[grid](
        payloads, _scales_view(payloads, n, spec), out, weights,
        n, nb, codes_nbytes(n, spec), k, nbytes, nbytes // 4,
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        HAS_WEIGHTS=weights is not None,
        num_warps=_num_warps(spec), enable_fp_fusion=False,
    )


def _uniform_stream(seed: int, start: int, count: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Test hook: float32 ``[count]``, the in-kernel random stream for element indices
    ``start .. start + count - 1`` (``start`` a multiple of 1024, in [0, 2**63)); must equal
    :func:`qcomm.kernels.counter_hash.uniform` bit for bit."""
    seed = check_seed(seed)
    if start % _HASH_TILE or not 0 <= start < 2**63 - count:
        raise ValueError(f"start must be a multiple of {_HASH_TILE} in [0, 2**63), got {start}")
    out = torch.empty(count, dtype=torch.float32, device=device)
    if count:
        _uniform_kernel[(triton.cdiv(count, _HASH_TILE),)](
            out, start, count, *_seed_halves(seed), TILE=_HASH_TILE,
            enable_fp_fusion=False,
        )
    return out


# ---------------------------------------------------------------------------------------------
# public functions (same contract as qcomm.kernels.reference)


def quantize_into(x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                  error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                  seed: int) -> None:
    """Quantize ``x`` (+ ``error_in``) into ``payload``; write the new residual to ``error_out``.
    One fused kernel: each input byte is read once, each output byte written once.

    Args:
        x: float32/float16/bfloat16 ``[n]``, contiguous.
        spec: the QuantSpec.
        payload: uint8 ``[packed_nbytes(n, spec)]``, contiguous, written whole.
        error_in: float32 ``[n]`` residual added before quantizing, or None.
        error_out: float32 ``[n]`` receiving ``v - D(payload)``, or None. May alias ``error_in``
            (every element is read and written by the same program).
        seed: int in [0, 2**64), stochastic-rounding seed (ignored for nearest rounding).

    Blocks holding non-finite values get a NaN scale and zero codes; their ``error_out``
    entries are those of the reference up to NaN bit patterns (the wire format leaves them
    unspecified).
    """
    _launch_quantize(x, spec, payload, error_in, error_out, seed)


def dequantize_into(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Decode uint8 ``payload`` ``[packed_nbytes(n, spec)]`` into ``out``: float32/float16/
    bfloat16 ``[n]``, contiguous (values rounded to nearest even into 16-bit dtypes)."""
    _launch_dequantize(payload, spec, out)


def dequant_accumulate_into(payloads: torch.Tensor, spec: QuantSpec, out: torch.Tensor,
                            weights: torch.Tensor | None) -> None:
    """``out += sum_k weights[k] * D(payloads[k])``, k in order, one rounding per operation,
    in one pass: ``out`` is read and written once, the K decoded payloads live in registers.

    Args:
        payloads: uint8 ``[K, packed_nbytes(n, spec)]``, contiguous.
        spec: the QuantSpec the payloads were made with.
        out: float32 ``[n]``, contiguous, updated in place.
        weights: float32 ``[K]`` on out's device, or None (all ones, no multiply).
    """
    _launch_dequant_accumulate(payloads, spec, out, weights)
