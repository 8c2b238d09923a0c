"""The qcomm wire format: one spec, one byte layout, shared by every backend.

A message quantizes ``numel`` float values with a :class:`QuantSpec` into ONE contiguous
``uint8`` payload whose length is a pure function of ``(numel, spec)``, so peers need no header.

Byte layout of a payload (``nblocks = ceil(numel / block_size)``)::

    [0, codes_nbytes)                    packed codes, element i at bit (i * bits) of the stream:
                                         byte (i * bits) // 8, bit offset (i * bits) % 8; the
                                         low bits of a byte hold the lower element index. Codes
                                         of padding elements (i >= numel) and alignment bytes
                                         are 0.
    [codes_nbytes, codes_nbytes + 4 * nblocks)
                                         one float32 scale per block, little-endian.

``codes_nbytes = 4 * ceil(numel * bits / 32)``: the codes are padded to a multiple of 4 bytes so
the scales are 4-byte aligned (a float32 view of them is legal on every device).

Codes (``L = 2 ** (bits - 1) - 1``):

* ``bits`` 4 and 8: symmetric per-block absmax. ``scale`` is ``absmax / L`` rounded to nearest,
  then raised by one ulp if ``fl(scale * L) < absmax`` (so the top level reaches absmax; this
  matters for subnormal scales, whose rounding error is large), then lowered by one ulp if
  ``fl(scale * L)`` overflows (absmax == FLT_MAX at 8 bits, the only such float32). The level
  ``q = round(v / scale)``, clamped to ``[-L, L]`` (``fl(v / scale)`` can exceed L by an ulp), is
  stored as the unsigned code ``q + L`` in ``[0, 2L]``; ``D(code) = (code - L) * scale``. A block
  of zeros has ``scale = 0`` and decodes to zeros.
* ``bits == 2``: all four codes are levels, ``{-1, -1/3, 1/3, 1} * scale`` with ``scale =
  absmax`` (stored as is, no rounding). See "The 2-bit code" below.
* ``bits == 1``: ``scale`` is the block's mean absolute value, summed pairwise in float64 in a
  fixed tree order (so every backend gets the same bits) and divided by the number of real
  elements of the block; code 1 means ``+scale`` (``v >= 0``), code 0 means ``-scale``.

A block whose input holds NaN or +-Inf gets a NaN scale: that is how the caller finds non-finite
input without another pass over the data.

Stochastic rounding uses ``q = floor(t) + (r < t - floor(t))`` with ``t = v / scale`` and ``r`` in
``[0, 1)`` drawn from :mod:`qcomm.kernels.counter_hash` of ``(seed, element index)``.

The 2-bit code
--------------
A symmetric code with levels ``-L..L`` uses three of the four 2-bit codes (ternary ``{-1, 0, 1}
* absmax``); on N(0, 1) in blocks of 128 its relative error under stochastic rounding is 1.12,
worse than sending nothing. Version 2 of the format uses all four, equally spaced::

    code        0     1            2           3
    level       -1    -fl(1/3)     +fl(1/3)    +1          fl(1/3) = 0x3EAAAAAB = 1/3 + u/6
    D(code) = fl(level * scale)                            (one float32 multiply, as 4 and 8 bits)

``scale = absmax`` exactly, so the top level reaches absmax and ``D`` never overflows: the ulp
bump and the overflow lowering of 4 and 8 bits have nothing to correct and do not apply. The
level of a code is also ``fl((code - 1.5) * fl(2/3))``, exactly (``fl(2/3) = 2 fl(1/3)``, and
``1.5 * fl(2/3)`` rounds to 1). The encoder places ``v`` on the grid of codes, ``k`` in
``[0, 3]``, in three float32 operations in this order (each rounded to nearest even, no fused
multiply-add)::

    t = fl(v / scale)        (t = 0 when scale == 0)
    h = fl(t * 1.5)
    k = fl(h + 1.5)

Nearest rounding sends ``round_half_even(k)``; stochastic rounding sends
``floor(k) + (r < k - floor(k))``, ``r`` as above (``k - floor(k)`` is exact). No clamp is
needed: IEEE rounding is monotone, so ``|v| <= scale`` gives ``|t| <= 1``, ``|h| <= 1.5`` and
``0 <= k <= 3`` (the codes of 4 and 8 bits need theirs because their scale is rounded).
A block of zeros has ``scale = 0`` and decodes to (signed) zeros.

Error bounds (``u = 2**-24``; ``s = scale``; ``Delta = 2 s / 3`` the spacing of the levels). With
``kappa = 1.5 v / s + 1.5``, the exact grid position: ``|t - v/s| <= u`` (``|t| <= 1``), the
product adds ``<= u |h| <= 1.5 u`` and the sum ``<= ulp(k) / 2 <= 2 u`` (``k < 4``), so
``|k - kappa| <= 1.5 u + 1.5 u + 2 u = 5 u``. The affine map ``A(c) = (c - 1.5) Delta`` has
``A(kappa) = v`` and ``A(c) = D(c)`` at the outer codes; at the inner ones
``|fl(fl(1/3) s) - s/3| <= (u/6) s + u (1/3 + u/6) s = (u/2 + u**2/6) s`` (plus ``2**-150`` if
subnormal), i.e. ``(3/4 + u/4) u Delta``. Hence

* nearest: ``|c - kappa| <= 1/2 + 5 u``, so
  ``|D(c) - v| <= s/3 + (23/6 + u/6) u s + 2**-150 <= s/3 + 4 u s + 2**-150``;
* stochastic: ``P(c = floor(k) + 1)`` differs from ``k - floor(k)`` by less than ``2**-24``
  (``r`` is a multiple of it), so ``|E[D(c)] - v| <= Delta (2**-24 + 6 u) + 2**-149``, and each
  draw is one of the two levels around ``v``: ``|D(c) - v| <= Delta (1 + 6 u) + 2**-150``.

:mod:`qcomm.testing.properties` checks these bounds (``QcommCodec.level_slack = 6``: the
``5.75 + u/4`` above, rounded up).

Versions
--------
:data:`WIRE_FORMAT_VERSION` numbers the byte layout and the arithmetic above; a payload carries
no header, so peers (and saved payloads) must agree on it. 1: the first format (2-bit codes
ternary). 2: the four-level 2-bit code; bits 1, 4 and 8 give the same bytes as in version 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from qcomm.validation import check_choice, check_instance, check_int, fail

WIRE_FORMAT_VERSION = 2
"""Version of the byte layout and arithmetic of a payload (see the module docstring)."""

# The constants of the arithmetic below, one source for every backend (the Triton kernels
# import them as constexprs).
ROUND_MAGIC = 12582912.0
"""1.5 * 2**23: ``(t + ROUND_MAGIC) - ROUND_MAGIC`` rounds float32 ``t`` to the nearest integer,
ties to even, for ``|t| < 2**22``: the same exact operation on every backend (Triton has no
portable rint), and unlike ``torch.round`` it never yields -0.0, which would change the sign of
a zero residual."""
ONE_THIRD = 0.3333333432674408
"""fl(1/3) = 0x3EAAAAAB, the inner level of the 2-bit code."""
TWO_THIRDS = 0.6666666865348816
"""fl(2/3) = 2 * ONE_THIRD exactly: the spacing of the 2-bit levels in units of the scale."""
NAN_F32_BITS = 0x7FC00000
"""The quiet NaN torch writes for ``float("nan")``: the scale of a non-finite block, these exact
bytes on every device."""

SUPPORTED_BITS = (1, 2, 4, 8)
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
ROUNDING_MODES = ("nearest", "stochastic")
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_NBYTES = 4

Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class QuantSpec:
    """How a tensor is quantized: code width, block size and rounding mode.

    Args:
        bits: code width, one of 1, 2, 4, 8.
        block_size: elements per scale, a power of two in [32, 4096].
        rounding: ``"nearest"`` (deterministic) or ``"stochastic"`` (unbiased, seeded).
            1-bit codes are ``sign(v) * mean|v|`` under either mode: deterministic and biased
            per message (error feedback removes the bias over steps); ``rounding`` only
            matters for ``bits >= 2``.
    """

    bits: int = 4
    block_size: int = 128
    rounding: Rounding = "nearest"

    def __post_init__(self) -> None:
        # An int first (TypeError for 2.0 or True), then one of the allowed values.
        check_int("bits", self.bits, what=f"one of {SUPPORTED_BITS}")
        check_choice("bits", self.bits, SUPPORTED_BITS)
        what = f"a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
        bs = check_int("block_size", self.block_size, low=MIN_BLOCK_SIZE, high=MAX_BLOCK_SIZE,
                       what=what)
        if bs & (bs - 1):
            fail("block_size", what, bs)
        check_choice("rounding", self.rounding, ROUNDING_MODES)

    @property
    def max_level(self) -> int:
        """L = 2**(bits-1) - 1, the largest |level| in units of the scale (``scale = absmax /
        L``). 1 at 2 bits, whose levels are ``{-1, -1/3, 1/3, 1} * absmax`` (codes 0..3, not
        ``q + L``); 0 at 1 bit, whose levels are ``+-scale``."""
        return (1 << (self.bits - 1)) - 1

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    @property
    def bits_per_value(self) -> float:
        """Average wire bits per element at full blocks (codes plus the block's scale)."""
        return self.bits + 8 * SCALE_NBYTES / self.block_size


def check_spec(spec: object, *, allow_none: bool = False) -> QuantSpec | None:
    """``spec`` if it is a QuantSpec (or None when allowed), else TypeError naming the public
    class (every layer checks a spec with this)."""
    return check_instance("spec", spec, QuantSpec, allow_none=allow_none,
                          what="a qcomm.compress.QuantSpec")  # type: ignore[return-value]


def num_blocks(numel: int, spec: QuantSpec) -> int:
    """Number of scale blocks, ceil(numel / block_size)."""
    return -(-numel // check_spec(spec).block_size)


def codes_nbytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the packed-codes section, padded to a multiple of 4 (scale alignment)."""
    return 4 * (-(-numel * check_spec(spec).bits // 32))


def packed_nbytes(numel: int, spec: QuantSpec) -> int:
    """Exact payload length in bytes for ``numel`` values under ``spec`` (0 for numel 0).

    Raises:
        TypeError: ``numel`` is not an int, or ``spec`` is not a QuantSpec. ValueError:
            ``numel`` is negative.
    """
    check_int("numel", numel, low=0)
    return codes_nbytes(numel, spec) + SCALE_NBYTES * num_blocks(numel, spec)


def split_payload(
    payload: torch.Tensor, numel: int, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a payload (uint8 ``[..., nbytes]``) as (codes uint8 ``[..., codes_nbytes]``,
    scales float32 ``[..., nblocks]``). No copy."""
    cn = codes_nbytes(numel, spec)
    codes = payload[..., :cn]
    if numel == 0:  # a float32 view of an empty uint8 slice fails for some strides
        return codes, payload.new_empty((*payload.shape[:-1], 0), dtype=torch.float32)
    scales = payload[..., cn:].view(torch.float32)
    return codes, scales
