"""Fused Triton codec: the CUDA backend of :mod:`qcomm.compress`, bit for bit equal to
:mod:`qcomm.kernels.reference`.

Three kernels, one per operation, each parameterized by constexprs instead of copied per variant:

* ``_quantize_kernel``: reads x (fp32/fp16/bf16) and the optional residual once, writes the
  packed codes, the block scales and the new residual once (error feedback in one pass).
* ``_dequantize_kernel``: reads a payload once, writes fp32/fp16/bf16 values once.
* ``_dequant_accumulate_kernel``: reads its slice of ``out`` once, decodes the K payloads one
  after the other in registers (``acc = acc + d * w``), writes ``out`` once; guarded, it
  weighs the payloads' largest scales beside (:mod:`qcomm.kernels.accumulate_guard`) and
  writes only a sum the rule allows.

Each program owns ``ROWS`` whole quantization blocks as a ``[ROWS, BLOCK_SIZE]`` tile
(``ROWS * BLOCK_SIZE`` = :data:`TILE_ELEMS` or one block if larger), so block reductions are
reductions along axis 1 and never cross programs. The two decoding kernels lay a block wider
than :data:`DECODE_ROW_ELEMS` out as several rows sharing its scale (:func:`_row_width`).

Bit-exactness with the CPU reference rests on a few rules, each applied below where it matters
(why each is needed: docs/wire_format.md, "Bit-exactness of the Triton kernels"): launches with
``enable_fp_fusion=False`` (no FMA); fp32 divisions by ``tl.math.div_rn`` (the 1-bit mean
divides in fp64); rounding to an integer by ``(t + 1.5 * 2**23) - 1.5 * 2**23``, floor derived
from it; bfloat16 conversions on the bits; the 1-bit mean summed in fp64 in the pairwise tree
of :func:`qcomm.kernels.reference.pairwise_sum_f64`; int64 element indices (tensors past 2**31
elements), int32 offsets inside a tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qcomm.kernels.accumulate_guard import FLOAT32_MAX, MAX_ABS_LEVEL, ULP_SLACK, AccumulateGuard
from qcomm.kernels.wire_format import (
    NAN_F32_BITS,
    ONE_THIRD,
    ROUND_MAGIC,
    QuantSpec,
    codes_nbytes,
    num_blocks,
    payload_scales,
)
from qcomm.seeds import HI_SALT, MIX_MUL_1, MIX_MUL_2
from qcomm.validation import check_seed

__all__ = ["dequant_accumulate_into", "dequantize_into", "quantize_into"]

# Elements per program. 2048 fp32 values are 16 per thread at 4 warps: enough bytes in flight
# per SM for a memory-bound kernel without spilling the [ROWS, BLOCK_SIZE] tile.
TILE_ELEMS = 2048
DECODE_ROW_ELEMS = 512  # the widest row of a decoding tile: see _row_width
# The wire format's constants (qcomm.kernels.wire_format) and the counter hash's (qcomm.seeds),
# as constexprs: one source for the kernels and the reference.
_ROUND_MAGIC = tl.constexpr(ROUND_MAGIC)
_ONE_THIRD = tl.constexpr(ONE_THIRD)
_NAN_F32_BITS = tl.constexpr(NAN_F32_BITS)
_MIX_MUL_1 = tl.constexpr(MIX_MUL_1)
_MIX_MUL_2 = tl.constexpr(MIX_MUL_2)
_HI_SALT = tl.constexpr(HI_SALT)
_FLOAT32_MAX = tl.constexpr(FLOAT32_MAX)
_ULP_SLACK = tl.constexpr(ULP_SLACK)
# Element count of one program of the test-only hash kernel (its start must be a multiple).
_HASH_TILE = 1024


# ---------------------------------------------------------------------------------------------
# shared @triton.jit helpers


@triton.jit
def _mix32(h):
    """lowbias32 on uint32 (products wrap mod 2**32, as counter_hash.mix32 emulates)."""
    h = h ^ (h >> 16)
    h = h * _MIX_MUL_1
    h = h ^ (h >> 15)
    h = h * _MIX_MUL_2
    return h ^ (h >> 16)


@triton.jit
def _tile_uniform(base, local, seed_lo, seed_hi):
    """counter_hash.uniform for element indices ``base + local``: ``base`` int64, a multiple of
    the tile (so the tile never straddles a 2**32 boundary and the key of the index's top half
    is computed once per program); ``local`` int32 in [0, tile). Returns float32 in [0, 1).
    The quantize kernel and the test hook ``_uniform_kernel`` both call exactly this."""
    key = _mix32(((base >> 32).to(tl.uint32)) ^ _HI_SALT)
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
                 BITS: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                 SUB: tl.constexpr):
    """Decode one tile of ``ROWS`` rows of ``WIDTH`` values, ``SUB`` rows per block (a block
    wider than a row is laid out as several: see :func:`_row_width`): ``codes_ptr`` /
    ``scales_ptr`` already point at the program's first byte / scale; ``byte_limit`` /
    ``block_limit`` are how many of them remain in the payload. Returns float32
    ``[ROWS, WIDTH]`` = level * scale (one rounding, as the reference)."""
    PER: tl.constexpr = 8 // BITS
    ROW_BYTES: tl.constexpr = WIDTH // PER
    r = tl.arange(0, ROWS)
    if PER == 1:
        byte = r[:, None] * ROW_BYTES + tl.arange(0, ROW_BYTES)[None, :]
        codes = tl.load(codes_ptr + byte, mask=byte < byte_limit, other=0).to(tl.int32)
    else:
        # Each thread holds 4 consecutive float32 of a row (one 16-byte vector of out), so it
        # is given the bits of exactly those 4 codes: a nibble, a byte or two bytes. Loaded
        # wider (the default vectorizes bytes by 4 or 16), they would cross between threads
        # through shared memory, with a barrier, once per payload.
        QUAD_BITS: tl.constexpr = 4 * BITS
        if QUAD_BITS < 8:  # 1-bit codes: two threads read each byte, a nibble each
            quad = tl.arange(0, WIDTH // 4)
            byte = r[:, None] * ROW_BYTES + (quad // 2)[None, :]
            raw = tl.load(codes_ptr + byte, mask=byte < byte_limit, other=0).to(tl.int32)
            raw = raw >> ((quad % 2) * 4)[None, :]
            per_unit: tl.constexpr = 4
        else:
            byte = r[:, None] * ROW_BYTES + tl.arange(0, ROW_BYTES)[None, :]
            byte = tl.max_contiguous(byte, [1, QUAD_BITS // 8])
            raw = tl.load(codes_ptr + byte, mask=byte < byte_limit, other=0).to(tl.int32)
            per_unit: tl.constexpr = PER
        # element 0 of a byte (of a nibble) sits in its low bits
        shifts = tl.arange(0, per_unit) * BITS
        codes = (raw[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(codes, [ROWS, WIDTH])
    if BITS == 1:
        q = (codes * 2 - 1).to(tl.float32)
    elif BITS == 2:
        q = _two_bit_level(codes)
    else:
        q = (codes - ((1 << (BITS - 1)) - 1)).to(tl.float32)
    block = r // SUB
    scale = tl.load(scales_ptr + block, mask=block < block_limit, other=0.0)
    return q * scale[:, None]


# ---------------------------------------------------------------------------------------------
# the steps of quantize, one helper per function of qcomm.kernels.reference (same name, same
# arithmetic in the same order), so the two can be read and compared side by side


@triton.jit
def _padded_input(x_ptr, err_in_ptr, base, local, real,
                  HAS_ERROR_IN: tl.constexpr, X_BF16: tl.constexpr):
    """reference._padded_input: float32 ``[ROWS, BLOCK_SIZE]`` of ``x (+ error_in)``, zeros past
    the end."""
    if X_BF16:
        v = _bf16_bits_to_f32(tl.load(x_ptr + base + local, mask=real, other=0))
    else:
        v = tl.load(x_ptr + base + local, mask=real, other=0.0).to(tl.float32)
    if HAS_ERROR_IN:
        v = v + tl.load(err_in_ptr + base + local, mask=real, other=0.0)
    return v


@triton.jit
def _finite_blocks(v):
    """bool ``[ROWS]``: the blocks without NaN or Inf. Counted explicitly: tl.max does not
    propagate NaN on every backend (the reference reads it off its scales instead)."""
    bad = ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
    return tl.sum(bad, axis=1) == 0


@triton.jit
def _pairwise_sum_f64(a, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """reference.pairwise_sum_f64 of each row of float64 ``a`` ``[ROWS, BLOCK_SIZE]``: level by
    level, element j of the next level is a[2j] + a[2j+1]. A sum over an axis of 2 is that one
    addition (fp addition commutes, so the order inside a pair is irrelevant). It compiles
    better than tl.split of the same reshape: for sm_90 at BLOCK_SIZE 4096, 58 registers
    instead of 255 plus spills."""
    for lvl in tl.static_range(12):  # 2**12 = MAX_BLOCK_SIZE
        if (BLOCK_SIZE >> lvl) > 1:
            a = tl.sum(tl.reshape(a, [ROWS, BLOCK_SIZE >> (lvl + 1), 2]), axis=2)
    return tl.reshape(a, [ROWS])


@triton.jit
def _block_scales(v, remaining, r, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  ROWS: tl.constexpr):
    """reference.block_scales: float32 ``[ROWS]`` scales of the tile's blocks (no NaN marking).
    ``remaining``: elements of x from the tile on; ``r``: the row indices."""
    if BITS == 1:
        # Mean |v| summed in fp64 in the fixed pairwise tree; padding elements are 0.
        total = _pairwise_sum_f64(tl.abs(v).to(tl.float64), ROWS, BLOCK_SIZE)
        count = tl.minimum(remaining - r * BLOCK_SIZE, BLOCK_SIZE)
        count = tl.maximum(count, 1).to(tl.float64)  # rows past the end: any nonzero divisor
        # fp64 `/` is IEEE round-to-nearest on CUDA (div.rn.f64); tl.math.div_rn and
        # fdiv(ieee_rounding=True) are fp32-only in the NVIDIA backend.
        scale = (total / count).to(tl.float32)
    elif BITS == 2:
        scale = tl.max(tl.abs(v), axis=1)  # the top level is absmax itself
    else:
        levels = tl.full([ROWS], (1 << (BITS - 1)) - 1, tl.float32)
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
    return scale


@triton.jit
def _safe_divide(v, s):
    """``v / s`` (IEEE ``div_rn``) per block, 0 where ``s == 0`` (reference._safe_divisor: a
    block of scale 0 holds only +-0)."""
    return tl.where(s == 0, 0.0, tl.math.div_rn(v, tl.where(s == 0, 1.0, s)))


@triton.jit
def _round(t, base, local, seed_lo, seed_hi, STOCHASTIC: tl.constexpr):
    """reference._round_in_place: nearest (ties to even) by the magic constant, or
    ``floor(t) + (r < t - floor(t))`` with the draws of element indices ``base + local``.
    floor(t) comes from the nearest integer: equal to torch.floor here except -0 -> +0, which
    leaves the result unchanged (fl + 0 is +0 either way)."""
    q = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    if STOCHASTIC:
        fl = tl.where(q > t, q - 1.0, q)
        rnd = _tile_uniform(base, local, seed_lo, seed_hi)  # the tile divides 2**32
        q = fl + (rnd < (t - fl)).to(tl.float32)
    return q


@triton.jit
def _symmetric_codes(v, s, valid, base, local, seed_lo, seed_hi, LEVEL: tl.constexpr,
                     STOCHASTIC: tl.constexpr):
    """reference._symmetric_codes (4 and 8 bits): codes ``q + L`` with ``q = round(v / s)`` in
    ``[-L, L]`` (0 outside ``valid``), and the decoded ``q * s``. ``s`` ``[ROWS, 1]``, NaN for
    non-finite blocks (the reference's scale there is NaN or Inf: every element decodes to NaN
    either way)."""
    q = _round(_safe_divide(v, s), base, local, seed_lo, seed_hi, STOCHASTIC)
    # fl(v / scale) can exceed L by an ulp: clamp to [-L, L] (with where, not minimum/maximum,
    # whose NaN handling differs between backends; NaN stays NaN).
    q = tl.where(q > LEVEL, LEVEL, tl.where(q < -LEVEL, -LEVEL, q))
    codes = tl.where(valid, q + LEVEL, 0.0).to(tl.int32)
    return codes, q * s


@triton.jit
def _two_bit_codes(v, s, valid, base, local, seed_lo, seed_hi, STOCHASTIC: tl.constexpr):
    """reference._two_bit_codes: code ``round(k)``, ``k = fl(fl(t * 1.5) + 1.5)`` the grid
    position in [0, 3] exactly (no clamp), and the decoded ``level(code) * s``. ``s`` is NaN
    for non-finite blocks, as in the reference."""
    k = _safe_divide(v, s) * 1.5 + 1.5  # two roundings: fusion is off
    q = _round(k, base, local, seed_lo, seed_hi, STOCHASTIC)
    codes = tl.where(valid, q, 0.0).to(tl.int32)
    return codes, _two_bit_level(q) * s


@triton.jit
def _one_bit_codes(v, s, valid):
    """reference._one_bit_codes: code 1 where ``v >= 0`` (-0.0 included), 0 below (and outside
    ``valid``); decoded ``+-s`` (the unmarked scale: +-Inf or NaN in bad blocks, as the
    reference)."""
    positive = v >= 0
    return (positive & valid).to(tl.int32), tl.where(positive, s, -s)


@triton.jit
def _pack(codes, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """reference._pack_into: int32 codes ``[ROWS, BLOCK_SIZE]`` -> packed bytes
    ``[ROWS, BLOCK_SIZE * BITS // 8]``, element 0 of a byte in its low bits."""
    PER: tl.constexpr = 8 // BITS
    if PER == 1:
        packed = codes
    else:
        shifts = tl.arange(0, PER) * BITS
        grouped = tl.reshape(codes, [ROWS, BLOCK_SIZE // PER, PER]) << shifts[None, None, :]
        packed = tl.sum(grouped, axis=2)  # disjoint bit fields: the sum is their OR
    return packed


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
    """reference._quantize_chunk for the tile of ``ROWS`` blocks of program ``pid``."""
    TILE: tl.constexpr = ROWS * BLOCK_SIZE
    ROW_BYTES: tl.constexpr = BLOCK_SIZE * BITS // 8

    pid = tl.program_id(0).to(tl.int64)
    base = pid * TILE  # first element of the tile, int64
    remaining = n - base  # elements of x from this tile on (may exceed TILE)
    r = tl.arange(0, ROWS)
    local = r[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]  # int32 [ROWS, B]
    real = local < remaining

    v = _padded_input(x_ptr, err_in_ptr, base, local, real, HAS_ERROR_IN, X_BF16)
    finite = _finite_blocks(v)  # [ROWS]
    valid = real & finite[:, None]
    scale = _block_scales(v, remaining, r, BITS, BLOCK_SIZE, ROWS)
    marked = tl.where(finite, scale, float("nan"))
    if BITS == 1:
        codes, decoded = _one_bit_codes(v, scale[:, None], valid)
    elif BITS == 2:
        codes, decoded = _two_bit_codes(v, marked[:, None], valid, base, local, seed_lo,
                                        seed_hi, STOCHASTIC)
    else:
        codes, decoded = _symmetric_codes(v, marked[:, None], valid, base, local, seed_lo,
                                          seed_hi, (1 << (BITS - 1)) - 1, STOCHASTIC)

    if HAS_ERROR_OUT:
        tl.store(err_out_ptr + base + local, v - decoded, mask=real)

    nan = tl.full([ROWS], _NAN_F32_BITS, tl.int32).to(tl.float32, bitcast=True)
    block_base = pid * ROWS
    tl.store(scales_ptr + block_base + r, tl.where(finite, scale, nan),
             mask=r < nblocks - block_base)

    packed = _pack(codes, BITS, ROWS, BLOCK_SIZE)
    byte_base = pid * (ROWS * ROW_BYTES)
    byte = r[:, None] * ROW_BYTES + tl.arange(0, ROW_BYTES)[None, :]
    # Codes of padding elements are 0, so the alignment bytes up to n_code_bytes come out 0.
    tl.store(codes_ptr + byte_base + byte, packed.to(tl.uint8),
             mask=byte < n_code_bytes - byte_base)


@triton.jit
def _decoding_program(n, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
                      WIDTH: tl.constexpr):
    """Where this program of a decoding kernel works: its first element, code byte and block
    (int64), the offsets of its tile's elements from the first (``[ROWS * SUB, WIDTH]``, rows
    of :func:`_row_width`) and the mask of those below ``n``."""
    TILE: tl.constexpr = ROWS * BLOCK_SIZE
    ROW_BYTES: tl.constexpr = BLOCK_SIZE * BITS // 8
    SUB: tl.constexpr = BLOCK_SIZE // WIDTH
    pid = tl.program_id(0).to(tl.int64)
    base = pid * TILE
    local = tl.arange(0, ROWS * SUB)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    return base, pid * (ROWS * ROW_BYTES), pid * ROWS, local, local < n - base


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, n, nblocks, n_code_bytes,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr,
    WIDTH: tl.constexpr,
):
    SUB: tl.constexpr = BLOCK_SIZE // WIDTH
    base, byte_base, block_base, local, real = _decoding_program(n, BITS, BLOCK_SIZE, ROWS,
                                                                 WIDTH)
    d = _decode_tile(codes_ptr + byte_base, scales_ptr + block_base, n_code_bytes - byte_base,
                     nblocks - block_base, BITS, WIDTH, ROWS * SUB, SUB)
    if OUT_BF16:
        tl.store(out_ptr + base + local, _f32_to_bf16_bits(d), mask=real)
    else:
        tl.store(out_ptr + base + local, d.to(out_ptr.dtype.element_ty), mask=real)


@triton.jit(do_not_specialize=["K"])  # K == 1 needs no variant of its own
def _dequant_accumulate_kernel(
    payloads_ptr, scales_ptr, out_ptr, w_ptr, smax_ptr, verdict_ptr, n, nblocks, n_code_bytes,
    K, payload_stride, scale_stride,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_GUARD: tl.constexpr, LEVEL: tl.constexpr,
    WIDTH: tl.constexpr,
):
    SUB: tl.constexpr = BLOCK_SIZE // WIDTH
    pid = tl.program_id(0).to(tl.int64)
    base, byte_base, block_base, local, real = _decoding_program(n, BITS, BLOCK_SIZE, ROWS,
                                                                 WIDTH)
    acc = tl.load(out_ptr + base + local, mask=real, other=0.0)
    # Walk the K payloads by pointer increments (64-bit addresses; k * stride never overflows).
    p_codes = payloads_ptr + byte_base
    p_scales = scales_ptr + block_base
    p_w = w_ptr
    p_smax = smax_ptr
    total = tl.zeros([], tl.float64)  # accumulate_guard's sum, k in order, in float64
    for _ in range(K):
        d = _decode_tile(p_codes, p_scales, n_code_bytes - byte_base, nblocks - block_base,
                         BITS, WIDTH, ROWS * SUB, SUB)
        if HAS_WEIGHTS:
            w = tl.load(p_w)
            d = d * w  # rounded product, then a rounded sum: no FMA (fusion is off)
            if HAS_GUARD:
                total = total + tl.abs(w.to(tl.float64)) * tl.load(p_smax).to(tl.float64)
            p_w += 1
        elif HAS_GUARD:
            total = total + tl.load(p_smax).to(tl.float64)
        if HAS_GUARD:  # with HAS_GUARD False, smax_ptr is None
            p_smax += 1
        acc = acc + d
        p_codes += payload_stride
        p_scales += scale_stride
    if HAS_GUARD:
        # Every program reaches the same verdict (the same K loads, the same roundings): the
        # first records it, and none stores a sum the rule refuses.
        factor = LEVEL * (1.0 + (K + 4).to(tl.float64) * _ULP_SLACK)
        ok = total * factor <= _FLOAT32_MAX
        if pid == 0:
            tl.store(verdict_ptr, ok)
        if ok:
            tl.store(out_ptr + base + local, acc, mask=real)
    else:
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
# launchers: grid, int64-safe arguments, launch


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


def _row_width(spec: QuantSpec) -> int:
    """Values per row of the decoding kernels' tiles: the block, or DECODE_ROW_ELEMS of it for
    wider blocks (laid out as several rows sharing one scale). A tile of one row of 2048 or
    4096 values is laid out by Triton so that the 2- and 4-bit code bytes cross between threads
    through shared memory, with a barrier, once per payload; as rows of 512 they stay with the
    thread whose values they decode, as in the tiles of several smaller blocks, at every width
    and block size without a spill (rows of 1024 spilled 4 B in the guarded 2-bit accumulate of
    blocks of 4096: tests/kernels/compile_sm90.py)."""
    return min(spec.block_size, DECODE_ROW_ELEMS)


def _num_warps(spec: QuantSpec) -> int:
    return 8 if _rows(spec) * spec.block_size >= 4096 else 4


def _grid(n: int, spec: QuantSpec) -> tuple[int, int, tuple[int]]:
    """(blocks per program, blocks, launch grid) for ``n`` elements."""
    rows = _rows(spec)
    nb = num_blocks(n, spec)
    return rows, nb, (triton.cdiv(nb, rows),)


# The launchers trust their arguments: qcomm.compress checked them (dtypes, lengths, layout,
# devices, the seed) before choosing this backend (qcomm.kernels.backend).


def _launch_quantize(x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                     error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                     seed: int) -> None:
    n = x.numel()
    if n == 0:
        return
    rows, nb, grid = _grid(n, spec)
    stochastic = spec.rounding == "stochastic" and spec.bits > 1
    _quantize_kernel[grid](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        error_in, error_out, payload, payload_scales(payload, n, spec),
        n, nb, codes_nbytes(n, spec), *_seed_halves(seed if stochastic else 0),
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        # 1-bit codes ignore the rounding mode: one compiled variant, not two
        STOCHASTIC=stochastic,
        HAS_ERROR_IN=error_in is not None, HAS_ERROR_OUT=error_out is not None,
        X_BF16=x.dtype == torch.bfloat16,
        num_warps=_num_warps(spec), enable_fp_fusion=False,
    )


def _launch_dequantize(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    n = out.numel()
    if n == 0:
        return
    rows, nb, grid = _grid(n, spec)
    _dequantize_kernel[grid](
        payload, payload_scales(payload, n, spec),
        out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
        n, nb, codes_nbytes(n, spec),
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        OUT_BF16=out.dtype == torch.bfloat16, WIDTH=_row_width(spec),
        num_warps=_num_warps(spec), enable_fp_fusion=False,
    )


def _launch_dequant_accumulate(payloads: torch.Tensor, spec: QuantSpec, out: torch.Tensor,
                               weights: torch.Tensor | None,
                               guard: AccumulateGuard | None) -> None:
    n = out.numel()
    k, nbytes = payloads.shape
    if n == 0 or k == 0:
        if guard is not None:
            guard.verdict.fill_(True)  # an empty sum: nothing to refuse
        return
    rows, nb, grid = _grid(n, spec)
    smax, verdict = (None, None) if guard is None else guard
    _dequant_accumulate_kernel[grid](
        payloads, payload_scales(payloads, n, spec), out, weights, smax, verdict,
        n, nb, codes_nbytes(n, spec), k, nbytes, nbytes // 4,
        BITS=spec.bits, BLOCK_SIZE=spec.block_size, ROWS=rows,
        HAS_WEIGHTS=weights is not None, HAS_GUARD=guard is not None,
        LEVEL=MAX_ABS_LEVEL[spec.bits], WIDTH=_row_width(spec),
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
                            weights: torch.Tensor | None,
                            guard: AccumulateGuard | None = None) -> None:
    """``out += sum_k weights[k] * D(payloads[k])``, k in order, one rounding per operation,
    in one pass: ``out`` is read and written once, the K decoded payloads live in registers.

    Args:
        payloads: uint8 ``[K, packed_nbytes(n, spec)]``, contiguous.
        spec: the QuantSpec the payloads were made with.
        out: float32 ``[n]``, contiguous, updated in place.
        weights: float32 ``[K]`` on out's device, or None (all ones, no multiply).
        guard: None, or the payloads' largest scales and the verdict to write: every program
            computes :mod:`qcomm.kernels.accumulate_guard`'s rule beside its sum and stores
            nothing the rule refuses; the first records the verdict (the host reads nothing).
    """
    _launch_dequant_accumulate(payloads, spec, out, weights, guard)
