"""Pure-torch reference codec: the CPU path and the oracle the Triton kernels are tested against.

Every function here computes exactly the arithmetic that :mod:`qcomm.kernels.wire_format`
specifies, in the same order and with the same roundings as the Triton kernels, so both produce
the same payload bytes and the same error buffers bit for bit. Vectorized over blocks; the only
Python loops are over chunks of :data:`CHUNK` elements (thousands of blocks each), the
log2(block_size) levels of the 1-bit pairwise sum and the K payloads of
:func:`dequant_accumulate_into`.

It is also the CPU fast path, so it is written as few passes over memory as eager torch allows
(measured in bench/kernels.py, figures in bench/results/2026-11-30-kernels-cpu.md):

* values are padded to whole blocks once, and every elementwise step runs on the
  ``[nblocks, block_size]`` view, in place where the previous result is not needed again;
* a block is non-finite exactly when its scale is (see :func:`block_scales`), so the NaN/Inf
  check costs nothing per element;
* codes live one per byte and are packed with integer arithmetic on wider views of those bytes
  (``w * M >> s`` gathers 8 or 4 codes of one word into its top byte, ``w | w >> 4`` two);
  decoding spreads them back with shifts and masks and turns codes into levels with 1-byte
  integer arithmetic before the one float conversion (the views assume a little-endian
  machine, as the float32 view of the payload's scales already does);
* no broadcasting ``torch.where`` (8.5 ms against 0.05 ms for a broadcasting multiply of 1M
  float32 on one core), no boolean temporaries where a float or byte one does, and no
  per-element NaN/Inf test.

The functions take validated, flat, contiguous tensors; argument checking lives in
:mod:`qcomm.compress`.
"""

from __future__ import annotations

import torch

from qcomm.kernels.accumulate_guard import AccumulateGuard, verdict_of
from qcomm.kernels.counter_hash import uniform
from qcomm.kernels.wire_format import (
    ONE_THIRD,
    ROUND_MAGIC,
    TWO_THIRDS,
    QuantSpec,
    num_blocks,
    split_payload,
)

# Packing 1 and 2 bits: codes one per byte, read as little-endian words of 8 or 4 bytes (byte i
# holds code i). w * multiplier puts code i at bit (first bit of the top byte) + i * bits, with
# no two partial products overlapping (so no carries), and >> shift brings the top byte down:
# one packed byte per word.
_PACK = {  # bits: (word dtype, multiplier, shift)
    1: (torch.int64, 0x0102040810204080, 56),  # code i * 2**(7 (7 - i) + 7 + 8 i) = 2**(56 + i)
    2: (torch.int32, 0x01041040, 24),          # code i * 2**(6 (3 - i) + 6 + 8 i) = 2**(24 + 2 i)
}
# Unpacking 1-bit: a byte b is copied into all 8 bytes of a word (b * 0x01..01, no carries), byte
# i keeps bit i (mask), adding 0x80 - 2**i to byte i sets its top bit exactly when bit i was
# set (no carries), and >> 7 & 0x01..01 leaves that bit as the byte's value.
_SPREAD1 = (0x0101010101010101, 0x8040201008040201 - (1 << 64),  # the mask, as a signed int64
            0x00406070787C7E7F, 0x0101010101010101)


# ---------------------------------------------------------------------------------------------
# scales


def pairwise_sum_f64(a: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two) in float64 in the fixed tree order the kernels use:
    level by level, element j of the next level is a[2j] + a[2j+1]."""
    a = a.to(torch.float64)
    lead, width = a.shape[:-1], a.shape[-1]
    # The levels alternate between two buffers (the widened input and one of half its size):
    # no allocation per level.
    bufs = (a.reshape(-1), torch.empty(a.numel() // 2, dtype=torch.float64, device=a.device))
    side = 1
    while width > 1:
        width //= 2
        nxt = bufs[side][:a.numel() // a.shape[-1] * width].view(*lead, width)
        torch.add(a[..., 0::2], a[..., 1::2], out=nxt)
        a, side = nxt, 1 - side
    return a[..., 0]


def block_scales(vb: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """float32 [nblocks] scales of blocked values ``vb`` [nblocks, block_size] (no NaN marking).

    A scale is finite exactly when its block is: absmax and the float64 sum of |v| propagate
    NaN and Inf, and for finite blocks neither the ulp bump nor the 1-bit mean can leave the
    float32 range (the mean is at most max|v|, the lowering keeps L * scale finite).
    """
    if spec.bits == 1:
        counts = torch.full((vb.shape[0],), spec.block_size, dtype=torch.float64, device=vb.device)
        if vb.shape[0]:
            counts[-1] = n - (vb.shape[0] - 1) * spec.block_size
        return (pairwise_sum_f64(vb.to(torch.float64).abs_()) / counts).to(torch.float32)
    absmax = vb.abs().amax(dim=1)
    if spec.bits == 2:
        return absmax  # the top level is absmax itself: nothing to bump or lower
    levels = float(spec.max_level)
    # A tensor divisor, not a Python float: on CUDA torch computes x / scalar as
    # x * fl(1 / scalar), which is one ulp off fl(x / L) for some x, and the reference on a
    # GPU would then disagree with itself on the CPU and with the kernels (which divide).
    scale = torch.div(absmax, torch.full_like(absmax, levels))
    # Round the scale up by one ulp where rounding made scale * L < absmax (mostly subnormal
    # scales, whose relative rounding error is large): the top level then reaches absmax.
    bumped = (scale.view(torch.int32) + 1).view(torch.float32)
    scale = torch.where(scale * levels < absmax, bumped, scale)
    # ...and down by one ulp where L * scale overflows (absmax == FLT_MAX at L = 127, the only
    # such float32): decoding the top level must stay finite. Levels are clamped to [-L, L].
    lowered = (scale.view(torch.int32) - 1).view(torch.float32)
    return torch.where(torch.isinf(scale * levels) & torch.isfinite(absmax), lowered, scale)


def _safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """float32 [nblocks, 1]: the scale, or 1 where it is 0. A block of scale 0 holds only +-0,
    and +-0 / 1 = +-0 goes through the rounding below exactly like the wire format's t = 0
    (rint and floor-plus-draw give +0, the 2-bit grid position 1.5)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]


# ---------------------------------------------------------------------------------------------
# codes of each width: (uint8 codes [m], decoded float32 [nblocks, block_size]) of blocked v


def _round_in_place(t: torch.Tensor, spec: QuantSpec, seed: int, start: int) -> None:
    """Round float32 ``t`` [nblocks, block_size] to integers in place: nearest (ties to even) or
    ``floor(t) + (r < t - floor(t))`` with the draws of element indices ``start, start + 1,
    ...``."""
    if spec.rounding == "nearest":
        t.add_(ROUND_MAGIC).sub_(ROUND_MAGIC)
        return
    fl = torch.floor(t)
    t.sub_(fl)  # the fraction, exact
    r = uniform(seed, start, t.numel(), t.device).view_as(t)
    torch.lt(r, t, out=t)  # 1.0 where the draw is below the fraction
    t.add_(fl)


def _symmetric_codes(vb: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, seed: int,
                     start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 and 8 bits: code q + L with q = round(v / scale) in [-L, L]; decoded q * scale."""
    big_l = spec.max_level
    q = torch.div(vb, _safe_divisor(scale))
    _round_in_place(q, spec, seed, start)
    if spec.rounding == "stochastic":
        # fl(v / scale) can exceed L by an ulp (double rounding of scale and t), and then a
        # draw can round it up to L + 1: clamp, so a code never leaves [0, 2L] and the residual
        # is computed from the level actually sent. Nearest rounding cannot get there: t stays
        # below L (1 + 2u)**2 < L + 1/2 since fl(scale * L) >= absmax (the bump, or an exact
        # product when subnormal), or t ~ L (1 + 2**-22) after the FLT_MAX lowering.
        q.clamp_(-float(big_l), float(big_l))
    codes = torch.empty(vb.numel(), dtype=torch.uint8, device=vb.device)
    codes.view(torch.int8).copy_(q.view(-1))  # q in [-127, 127]: exact (NaN: zeroed later)
    codes.add_(big_l)  # uint8 arithmetic wraps: (q mod 256) + L = q + L in [0, 2L]
    return codes, q.mul_(scale[:, None])


def _two_bit_codes(vb: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, seed: int,
                   start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2 bits: code round(k), k = fl(fl(fl(v / scale) * 1.5) + 1.5) in [0, 3] exactly (monotone
    roundings of |v| <= scale: no clamp); decoded level(code) * scale. ``scale`` is already NaN
    for non-finite blocks, as in the kernel."""
    k = torch.div(vb, _safe_divisor(scale))
    k.mul_(1.5).add_(1.5)  # two roundings, in this order (no fused multiply-add)
    _round_in_place(k, spec, seed, start)
    codes = torch.empty(vb.numel(), dtype=torch.uint8, device=vb.device)
    codes.view(torch.int8).copy_(k.view(-1))
    # level = fl((code - 1.5) * fl(2/3)): -1, -fl(1/3), fl(1/3), 1, then one multiply
    return codes, k.sub_(1.5).mul_(TWO_THIRDS).mul_(scale[:, None])


def _one_bit_codes(vb: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1 bit: code 1 where v >= 0 (-0.0 included), 0 below (and for NaN); decoded +-scale."""
    codes = (vb >= 0).view(torch.uint8).view(-1)
    return codes, _sign_levels(codes).view_as(vb).mul_(scale[:, None])


def _sign_levels(codes: torch.Tensor) -> torch.Tensor:
    """float32 +-1 of 1-bit codes (uint8 0/1): 2c - 1 in bytes (0 wraps to 255 = int8 -1)."""
    return (codes * 2).sub_(1).view(torch.int8).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# packing


def _pack_into(codes: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """uint8 codes [m] (one per byte, m a multiple of 8, m * bits / 8 >= out.numel()) -> the
    packed bytes ``out`` (uint8 [nbytes])."""
    nbytes = out.numel()
    if spec.bits == 8:
        out.copy_(codes[:nbytes])
    elif spec.bits == 4:
        w = codes.view(torch.int16)  # c0 | c1 << 8, both < 16
        out.copy_(torch.bitwise_or(w, w >> 4)[:nbytes])  # low byte c0 | c1 << 4 (copy wraps)
    else:
        dtype, mul, shift = _PACK[spec.bits]
        # int products wrap modulo 2**W (as counter_hash relies on); conversion to uint8 keeps
        # the low byte, which the shift made the top byte of the word
        out.copy_(((codes.view(dtype) * mul) >> shift)[:nbytes])


def _pack(codes: torch.Tensor, spec: QuantSpec, nbytes: int) -> torch.Tensor:
    """uint8 codes [m] (m a multiple of 8 // bits) -> packed uint8 [nbytes], a new tensor."""
    m = codes.numel()
    want = max(-(-m // 8) * 8, nbytes * spec.codes_per_byte)  # whole words, every byte made
    if want > m:
        codes = torch.nn.functional.pad(codes, (0, want - m))
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    _pack_into(codes.contiguous(), spec, out)
    return out


def _unpack_into(packed: torch.Tensor, spec: QuantSpec, codes: torch.Tensor) -> None:
    """Packed uint8 [nbytes] -> uint8 codes ``codes`` [m], one per byte (m * bits / 8 >=
    nbytes, m a multiple of 8); codes past the packed ones are 0."""
    nbytes = packed.numel()
    if spec.bits == 8:
        codes[:nbytes].copy_(packed)
        codes[nbytes:].zero_()
        return
    if spec.bits == 4:
        w = packed.to(torch.int16)  # c0 | c1 << 4
        w = torch.bitwise_or(w, w << 4).bitwise_and_(0x0F0F)  # c0 | c1 << 8
        words = codes.view(torch.int16)
    elif spec.bits == 2:
        w = packed.to(torch.int32)  # c0 | c1 << 2 | c2 << 4 | c3 << 6
        w = (w | (w << 6) | (w << 12) | (w << 18)).bitwise_and_(0x03030303)  # c_i << 8 i
        words = codes.view(torch.int32)
    else:
        rep, mask, add, low = _SPREAD1
        w = packed.to(torch.int64).mul_(rep).bitwise_and_(mask).add_(add)
        w = (w >> 7).bitwise_and_(low)  # byte i = bit i of the packed byte
        words = codes.view(torch.int64)
    words[:nbytes].copy_(w)
    words[nbytes:].zero_()


def unpack_codes(codes: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """packed uint8 [..., codes_nbytes] -> int32 codes [..., n] (for tests and tools; the codec
    itself decodes with :func:`_unpack_into`)."""
    if spec.bits == 8:
        return codes[..., :n].to(torch.int32)
    shifts = torch.arange(0, 8, spec.bits, dtype=torch.int32, device=codes.device)
    mask = (1 << spec.bits) - 1
    wide = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return wide.flatten(-2)[..., :n]


# ---------------------------------------------------------------------------------------------
# decoding


def _decode_into(packed: torch.Tensor, scales: torch.Tensor, spec: QuantSpec,
                 codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode one payload's packed codes (uint8 [codes_nbytes]) and scales (float32 [nblocks])
    into ``out`` (float32 [nblocks * block_size], returned as [nblocks, block_size]): level
    times the block's scale, one float32 multiply. ``codes`` (uint8, same numel) is scratch."""
    _unpack_into(packed, spec, codes)
    # Levels from codes in bytes, then one conversion: 2c - 1 (1 bit), 2c - 3 (2 bits, times
    # fl(1/3) below: 3 fl(1/3) rounds to 1), c - 7 (4 bits); int8 by wrapping. 8-bit codes
    # reach 255, past int8: converted first, then c - 127 in float32 (exact).
    if spec.bits == 8:
        out.copy_(codes)
        out.sub_(spec.max_level)
    else:
        if spec.bits == 4:
            codes.sub_(spec.max_level)
        else:
            codes.mul_(2).sub_(1 if spec.bits == 1 else 3)
        out.copy_(codes.view(torch.int8))
        if spec.bits == 2:
            out.mul_(ONE_THIRD)
    return out.view(scales.numel(), spec.block_size).mul_(scales[:, None])


# ---------------------------------------------------------------------------------------------
# public functions

# Elements per pass of the public functions below (a multiple of every block size): big tensors
# are coded in chunks of whole blocks, so temporaries stay small enough to be reused from the
# allocator's heap and to stay in cache (whole-tensor float64 temporaries of a 4M-element 1-bit
# message cost more in page faults than in arithmetic). 2**19: of 2**17..2**20, measured at 1M
# and 4M elements, the one neither slower nor erratic (bench/results/2026-11-30-kernels-cpu.md).
# Chunks change nothing in the result: blocks are independent, and each chunk draws the random
# numbers of its own element indices.
CHUNK = 1 << 19


def _chunks(n: int) -> range:
    return range(0, n, CHUNK)


def _padded_input(x: torch.Tensor, error_in: torch.Tensor | None, m: int) -> torch.Tensor:
    """float32 [m]: ``x (+ error_in)`` followed by zeros up to m (x itself when nothing is to
    add, convert or pad)."""
    n = x.numel()
    if m == n:
        if error_in is not None:
            return torch.add(x, error_in)  # fp16/bf16 x: widened exactly, then one fp32 add
        return x if x.dtype == torch.float32 else x.to(torch.float32)
    v = torch.empty(m, dtype=torch.float32, device=x.device)
    if error_in is not None:
        torch.add(x, error_in, out=v[:n])
    else:
        v[:n].copy_(x)
    v[n:].zero_()
    return v


def _quantize_chunk(x: torch.Tensor, spec: QuantSpec, out_codes: torch.Tensor,
                    out_scales: torch.Tensor, error_in: torch.Tensor | None,
                    error_out: torch.Tensor | None, seed: int, start: int) -> None:
    """:func:`quantize_into` of the elements ``start .. start + n - 1`` (``start`` a multiple of
    the block size): their packed codes, scales and residuals."""
    n = x.numel()
    nb = num_blocks(n, spec)
    v = _padded_input(x, error_in, nb * spec.block_size)
    vb = v.view(nb, spec.block_size)
    scale = block_scales(vb, n, spec)
    finite = torch.isfinite(scale)
    marked = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    if spec.bits == 1:
        codes, decoded = _one_bit_codes(vb, scale)  # residual from the unmarked scale
    elif spec.bits == 2:
        codes, decoded = _two_bit_codes(vb, marked, spec, seed, start)
    else:
        codes, decoded = _symmetric_codes(vb, scale, spec, seed, start)
    # Padding elements and non-finite blocks encode as 0 (the codes tensor is our own).
    codes[n:] = 0
    if not bool(finite.all()):
        codes.view(nb, spec.block_size)[~finite] = 0
    _pack_into(codes, spec, out_codes)
    out_scales.copy_(marked)
    if error_out is not None:
        torch.sub(v[:n], decoded.view(-1)[:n], out=error_out)


def quantize_into(x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                  error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                  seed: int) -> None:
    """Quantize ``x`` (+ ``error_in``) into ``payload``; write the new residual to ``error_out``.

    Args:
        x: float32/float16/bfloat16 ``[n]``, contiguous.
        payload: uint8 ``[packed_nbytes(n, spec)]``, written whole.
        error_in: float32 ``[n]`` residual added before quantizing, or None.
        error_out: float32 ``[n]`` receiving ``v - D(payload)``, or None. May alias ``error_in``
            (each chunk reads its residual before it writes it).
        seed: stochastic-rounding seed (ignored for nearest rounding).

    Blocks holding non-finite values get a NaN scale and zero codes; their ``error_out``
    entries are unspecified.
    """
    n = x.numel()
    codes, scales = split_payload(payload, n, spec)
    for lo in _chunks(n):
        hi = min(n, lo + CHUNK)
        part = slice(lo, hi)
        _quantize_chunk(
            x[part], spec, codes[lo * spec.bits // 8:hi * spec.bits // 8 if hi < n else None],
            scales[lo // spec.block_size:-(-hi // spec.block_size)],
            error_in[part] if error_in is not None else None,
            error_out[part] if error_out is not None else None, seed, lo)


def _payload_chunk(payload: torch.Tensor, n: int, spec: QuantSpec, lo: int,
                   hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales) of elements ``lo .. hi - 1`` of payloads ``[..., nbytes]``."""
    codes, scales = split_payload(payload, n, spec)
    return (codes[..., lo * spec.bits // 8:hi * spec.bits // 8 if hi < n else None],
            scales[..., lo // spec.block_size:-(-hi // spec.block_size)])


def dequantize_into(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Decode uint8 ``payload`` ``[packed_nbytes(n, spec)]`` into ``out`` (float ``[n]``)."""
    n = out.numel()
    for lo in _chunks(n):
        hi = min(n, lo + CHUNK)
        packed, scales = _payload_chunk(payload, n, spec, lo, hi)
        m = scales.numel() * spec.block_size
        codes = torch.empty(m, dtype=torch.uint8, device=out.device)
        if m == hi - lo and out.dtype == torch.float32:  # decode in place
            _decode_into(packed, scales, spec, codes, out[lo:hi])
            continue
        buf = torch.empty(m, dtype=torch.float32, device=out.device)
        out[lo:hi].copy_(_decode_into(packed, scales, spec, codes, buf).view(-1)[:hi - lo])


def dequant_accumulate_into(payloads: torch.Tensor, spec: QuantSpec, out: torch.Tensor,
                            weights: torch.Tensor | None,
                            guard: AccumulateGuard | None = None) -> None:
    """``out += sum_k weights[k] * D(payloads[k])``, k in order, one rounding per operation.

    Args:
        payloads: uint8 ``[K, packed_nbytes(n, spec)]``.
        out: float32 ``[n]``, updated in place.
        weights: float32 ``[K]`` or None (all ones, no multiply).
        guard: None, or the payloads' largest scales and the verdict to write: the sum is
            written only when :mod:`qcomm.kernels.accumulate_guard`'s rule allows it. Decided
            on the host here (free on the CPU, the reference's device; the Triton kernel
            decides on the GPU).
    """
    if guard is not None:
        ok = verdict_of(guard.scale_max, weights, spec.bits)
        guard.verdict.fill_(ok)
        if not ok:
            return
    n = out.numel()
    for lo in _chunks(n):
        hi = min(n, lo + CHUNK)
        packed, scales = _payload_chunk(payloads, n, spec, lo, hi)
        m = scales.shape[-1] * spec.block_size
        codes = torch.empty(m, dtype=torch.uint8, device=out.device)
        buf = torch.empty(m, dtype=torch.float32, device=out.device)
        for k in range(payloads.shape[0]):  # in order: out + d_0, then + d_1, ...
            d = _decode_into(packed[k], scales[k], spec, codes, buf)
            if weights is not None:
                d.mul_(weights[k])  # a separate product, then a separate sum: no FMA
            out[lo:hi].add_(buf[:hi - lo])
