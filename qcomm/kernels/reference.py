"""Pure-torch reference codec: the CPU path and the oracle the Triton kernels are tested against.

Every function here computes exactly the arithmetic that :mod:`qcomm.kernels.wire_format`
specifies, in the same order and with the same roundings as the Triton kernels, so both produce
the same payload bytes and the same error buffers bit for bit. Vectorized over blocks; the only
Python loops are over the log2(block_size) levels of the 1-bit pairwise sum and over the K
payloads of :func:`dequant_accumulate_into`.

The functions take validated, flat, contiguous tensors; argument checking lives in
:mod:`qcomm.compress`.
"""

from __future__ import annotations

import torch

from qcomm.kernels.counter_hash import uniform
from qcomm.kernels.wire_format import QuantSpec, codes_nbytes, num_blocks, split_payload

# t + 1.5 * 2**23 - 1.5 * 2**23 rounds float32 t to the nearest integer, ties to even, for
# |t| < 2**22: the same exact operation on every backend (Triton has no portable rint).
ROUND_MAGIC = 12582912.0
# fl(1/3) = 0x3EAAAAAB, the inner level of the 2-bit code; fl(2/3) = 2 * ONE_THIRD exactly.
ONE_THIRD = 0.3333333432674408
TWO_THIRDS = 0.6666666865348816


def _blocks(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """float32 [n] -> [nblocks, block_size], zero-padded."""
    n = v.numel()
    nb = num_blocks(n, spec)
    pad = nb * spec.block_size - n
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return v.view(nb, spec.block_size)


def pairwise_sum_f64(a: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two) in float64 in the fixed tree order the kernels use:
    level by level, element j of the next level is a[2j] + a[2j+1]."""
    a = a.to(torch.float64)
    while a.shape[-1] > 1:
        a = a[..., 0::2] + a[..., 1::2]
    return a[..., 0]


def block_scales(vb: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """float32 [nblocks] scales of blocked values ``vb`` [nblocks, block_size] (no NaN marking)."""
    if spec.bits == 1:
        counts = torch.full((vb.shape[0],), spec.block_size, dtype=torch.float64, device=vb.device)
        if vb.shape[0]:
            counts[-1] = n - (vb.shape[0] - 1) * spec.block_size
        return (pairwise_sum_f64(vb.abs()) / counts).to(torch.float32)
    absmax = vb.abs().amax(dim=1)
    if spec.bits == 2:
        return absmax  # the top level is absmax itself: nothing to bump or lower
    levels = float(spec.max_level)
    scale = absmax / levels
    # Round the scale up by one ulp where rounding made scale * L < absmax (mostly subnormal
    # scales, whose relative rounding error is large): the top level then reaches absmax.
    bumped = (scale.view(torch.int32) + 1).view(torch.float32)
    scale = torch.where(scale * levels < absmax, bumped, scale)
    # ...and down by one ulp where L * scale overflows (absmax == FLT_MAX at L = 127, the only
    # such float32): decoding the top level must stay finite. Levels are clamped to [-L, L].
    lowered = (scale.view(torch.int32) - 1).view(torch.float32)
    return torch.where(torch.isinf(scale * levels) & torch.isfinite(absmax), lowered, scale)


def _levels(vb: torch.Tensor, scale: torch.Tensor, start: int, spec: QuantSpec,
            seed: int) -> torch.Tensor:
    """float32 [nblocks, block_size] signed levels q (bits 4 and 8) for blocked values."""
    s = scale[:, None]
    t = torch.where(s == 0, torch.zeros_like(vb), vb / s)
    if spec.rounding == "nearest":
        q = (t + ROUND_MAGIC) - ROUND_MAGIC
    else:
        fl = torch.floor(t)
        r = uniform(seed, start, vb.numel(), vb.device).view_as(vb)
        q = fl + (r < (t - fl)).to(torch.float32)
    # fl(v / scale) can exceed L by an ulp (double rounding of scale and t): clamp, so a
    # code never leaves [0, 2L] and the residual is computed from the level actually sent.
    return q.clamp(-float(spec.max_level), float(spec.max_level))


def two_bit_codes(vb: torch.Tensor, scale: torch.Tensor, start: int, spec: QuantSpec,
                  seed: int) -> torch.Tensor:
    """float32 [nblocks, block_size] 2-bit codes in {0, 1, 2, 3} of blocked values (wire format,
    "The 2-bit code"): k = fl(fl(fl(v / scale) * 1.5) + 1.5), then rounded. k lies in [0, 3]
    exactly (monotone roundings of |v| <= scale), so no clamp; NaN where the block is not
    finite."""
    s = scale[:, None]
    t = torch.where(s == 0, torch.zeros_like(vb), vb / s)
    k = (t * 1.5) + 1.5  # two roundings, in this order (no fused multiply-add on any backend)
    if spec.rounding == "nearest":
        return (k + ROUND_MAGIC) - ROUND_MAGIC
    fl = torch.floor(k)
    r = uniform(seed, start, vb.numel(), vb.device).view_as(vb)
    return fl + (r < (k - fl)).to(torch.float32)


def two_bit_levels(codes: torch.Tensor) -> torch.Tensor:
    """float32 levels -1, -fl(1/3), fl(1/3), 1 of 2-bit codes 0..3 (float32 tensor, any shape):
    fl((code - 1.5) * fl(2/3)), exact in both operations but the last (1.5 * fl(2/3) rounds
    to 1)."""
    return (codes - 1.5) * TWO_THIRDS


def _pack(codes: torch.Tensor, spec: QuantSpec, nbytes: int) -> torch.Tensor:
    """uint8 codes [m] (m a multiple of 8 // bits) -> packed uint8 [nbytes]."""
    if spec.bits == 8:
        return codes[:nbytes]
    per = spec.codes_per_byte
    shifts = torch.arange(0, 8, spec.bits, dtype=torch.int32, device=codes.device)
    grouped = codes.view(-1, per).to(torch.int32) << shifts
    return grouped.sum(dim=1).to(torch.uint8)[:nbytes]


def unpack_codes(codes: torch.Tensor, n: int, spec: QuantSpec) -> torch.Tensor:
    """packed uint8 [..., codes_nbytes] -> int32 codes [..., n]."""
    if spec.bits == 8:
        return codes[..., :n].to(torch.int32)
    shifts = torch.arange(0, 8, spec.bits, dtype=torch.int32, device=codes.device)
    mask = (1 << spec.bits) - 1
    wide = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return wide.flatten(-2)[..., :n]


def decode_values(codes: torch.Tensor, scales: torch.Tensor, n: int,
                  spec: QuantSpec) -> torch.Tensor:
    """Decode int32 codes [..., n] with float32 scales [..., nblocks] to float32 [..., n]."""
    nb = scales.shape[-1]
    pad = nb * spec.block_size - n
    if spec.bits == 1:
        q = (codes * 2 - 1).to(torch.float32)
    elif spec.bits == 2:
        q = two_bit_levels(codes.to(torch.float32))
    else:
        q = (codes - spec.max_level).to(torch.float32)
    # One float32 product per element, level times its block's scale: broadcast over the
    # blocked view rather than gathering a scale per element (no int64 index tensor).
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    blocked = q.view(*q.shape[:-1], nb, spec.block_size) * scales.unsqueeze(-1)
    return blocked.flatten(-2)[..., :n]


def quantize_into(x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                  error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                  seed: int) -> None:
    """Quantize ``x`` (+ ``error_in``) into ``payload``; write the new residual to ``error_out``.

    Args:
        x: float32/float16/bfloat16 ``[n]``, contiguous.
        payload: uint8 ``[packed_nbytes(n, spec)]``, written whole.
        error_in: float32 ``[n]`` residual added before quantizing, or None.
        error_out: float32 ``[n]`` receiving ``v - D(payload)``, or None. May alias ``error_in``.
        seed: stochastic-rounding seed (ignored for nearest rounding).

    Blocks holding non-finite values get a NaN scale and zero codes; their ``error_out``
    entries are unspecified.
    """
    n = x.numel()
    if n == 0:
        return
    v = x.to(torch.float32)
    v = v + error_in if error_in is not None else v
    vb = _blocks(v, spec)
    finite = torch.isfinite(vb).all(dim=1)
    scale = block_scales(vb, n, spec)
    if spec.bits == 1:
        positive = vb >= 0
        codes = positive.to(torch.uint8)
        decoded = torch.where(positive, scale[:, None], -scale[:, None])
    elif spec.bits == 2:
        # NaN scale first, as the kernel: every element of a non-finite block decodes to NaN,
        # so its residual is NaN on both backends (an Inf scale would give +-Inf residuals).
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        c = two_bit_codes(vb, scale, 0, spec, seed)
        codes = c.to(torch.uint8)
        decoded = two_bit_levels(c) * scale[:, None]
    else:
        q = _levels(vb, scale, 0, spec, seed)
        codes = (q + spec.max_level).to(torch.uint8)
        decoded = q * scale[:, None]
    # Padding elements and non-finite blocks encode as 0 (the codes tensor is our own).
    codes.view(-1)[n:] = 0
    if not bool(finite.all()):
        codes[~finite] = 0
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))

    out_codes, out_scales = split_payload(payload, n, spec)
    out_codes.copy_(_pack(codes.flatten(), spec, codes_nbytes(n, spec)))
    out_scales.copy_(scale)
    if error_out is not None:
        error_out.copy_(v - decoded.flatten()[:n])


def dequantize_into(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """Decode uint8 ``payload`` ``[packed_nbytes(n, spec)]`` into ``out`` (float ``[n]``)."""
    n = out.numel()
    if n == 0:
        return
    codes, scales = split_payload(payload, n, spec)
    out.copy_(decode_values(unpack_codes(codes, n, spec), scales, n, spec))


def dequant_accumulate_into(payloads: torch.Tensor, spec: QuantSpec, out: torch.Tensor,
                            weights: torch.Tensor | None) -> None:
    """``out += sum_k weights[k] * D(payloads[k])``, k in order, one rounding per operation.

    Args:
        payloads: uint8 ``[K, packed_nbytes(n, spec)]``.
        out: float32 ``[n]``, updated in place.
        weights: float32 ``[K]`` or None (all ones, no multiply).
    """
    n = out.numel()
    if n == 0:
        return
    codes, scales = split_payload(payloads, n, spec)
    for k in range(payloads.shape[0]):
        d = decode_values(unpack_codes(codes[k], n, spec), scales[k], n, spec)
        if weights is not None:
            d = d * weights[k]  # a separate product, then a separate sum: no fused multiply-add
        out.add_(d)
