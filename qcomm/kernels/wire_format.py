"""The qcomm wire format: one spec, one byte layout, shared by every backend.

A message quantizes ``numel`` float values with a :class:`QuantSpec` into ONE contiguous
``uint8`` payload whose length is a pure function of ``(numel, spec)``, so peers need no header::

    [packed codes, padded to a multiple of 4 bytes][one float32 scale per block, little-endian]

Element i's code is at bit ``i * bits`` of the code stream, the low bits of a byte holding the
lower index; ``codes_nbytes = 4 * ceil(numel * bits / 32)``, ``ceil(numel / block_size)``
blocks. Codes (``L = 2 ** (bits - 1) - 1``):

* ``bits`` 4 and 8: symmetric per-block absmax, the level ``q = round(v / scale)`` clamped to
  ``[-L, L]`` and stored as ``q + L``; ``scale`` is ``absmax / L`` rounded to nearest, moved by
  one ulp where ``fl(scale * L)`` falls short of absmax or overflows;
* ``bits == 2``: all four codes are levels, ``{-1, -1/3, 1/3, 1} * absmax``;
* ``bits == 1``: the sign times the block's mean absolute value (float64, fixed pairwise tree).

A block whose input holds NaN or +-Inf gets a NaN scale: that is how the caller finds non-finite
input without another pass over the data. Stochastic rounding draws ``r`` in ``[0, 1)`` from
:mod:`qcomm.kernels.counter_hash` of ``(seed, element index)``. Every operation and rounding is
specified, so every backend writes the same bytes.

:data:`WIRE_FORMAT_VERSION` numbers the byte layout and the arithmetic; a payload carries no
header, so peers (and saved payloads) must agree on it.

The full specification: docs/wire_format.md, sections "Byte layout", "Codes", "The 2-bit code"
(its arithmetic and error bounds) and "Versions".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from qcomm.validation import check_choice, check_instance, check_int, fail

WIRE_FORMAT_VERSION = 2
"""Version of the byte layout and arithmetic of a payload (docs/wire_format.md, "Versions")."""

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


@lru_cache(maxsize=4096)
def _section_nbytes(numel: int, spec: QuantSpec) -> tuple[int, int]:
    """(codes section, whole payload) in bytes for checked arguments. Every codec call asks
    for them with the same few sizes: remembered, they cost a lookup instead of the checks
    and the arithmetic."""
    codes = 4 * (-(-numel * spec.bits // 32))
    return codes, codes + SCALE_NBYTES * -(-numel // spec.block_size)


def codes_nbytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the packed-codes section, padded to a multiple of 4 (scale alignment)."""
    return 4 * (-(-numel * check_spec(spec).bits // 32))


def packed_nbytes(numel: int, spec: QuantSpec) -> int:
    """Exact payload length in bytes for ``numel`` values under ``spec`` (0 for numel 0).

    Raises:
        TypeError: ``numel`` is not an int, or ``spec`` is not a QuantSpec. ValueError:
            ``numel`` is negative.
    """
    return _section_nbytes(check_int("numel", numel, low=0), check_spec(spec))[1]


def split_payload(
    payload: torch.Tensor, numel: int, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a payload (uint8 ``[..., nbytes]``) as (codes uint8 ``[..., codes_nbytes]``,
    scales float32 ``[..., nblocks]``). No copy."""
    return payload[..., :codes_nbytes(numel, spec)], payload_scales(payload, numel, spec)


def payload_scales(payload: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """The float32 ``[..., nblocks]`` view of a payload's scales (uint8 ``[..., nbytes]``), no
    copy: :func:`split_payload`'s second view alone, for the many callers that need only it."""
    if numel == 0:  # a float32 view of an empty uint8 slice fails for some strides
        return payload.new_empty((*payload.shape[:-1], 0), dtype=torch.float32)
    cn = _section_nbytes(numel, check_spec(spec))[0]
    return (payload[cn:] if payload.dim() == 1 else payload[..., cn:]).view(torch.float32)
