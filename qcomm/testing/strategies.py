"""Hypothesis strategies for adversarial inputs to block-quantization codecs.

Needs hypothesis (``pip install -e '.[test]'`` in a qcomm checkout); the rest of
:mod:`qcomm.testing` does not.

Usable for any codec, not only qcomm's::

    from hypothesis import given
    from qcomm.testing.strategies import adversarial_tensors, lengths, quant_specs

    @given(spec=quant_specs(), data=st.data())
    def test_my_codec(spec, data):
        x = data.draw(adversarial_tensors(lengths(spec.block_size), block_size=spec.block_size))
        ...

What makes a tensor adversarial for a per-block codec is what happens inside one block, so
:func:`adversarial_tensors` draws a *kind* per block (see :data:`KINDS`): ordinary values, all
zeros, signed zeros, subnormals, huge and tiny magnitudes, one outlier, a constant, exact
rounding ties. Hypothesis chooses the kinds (and shrinks them towards ``"normal"``); the bulk of
the values comes from a numpy generator seeded by one drawn integer, so a tensor of thousands of
elements costs a few dozen draws, not one per element.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(
        "qcomm.testing.strategies needs hypothesis, which qcomm does not install by default: "
        "pip install -e '.[test]' in a qcomm checkout (its test extra) or pip install hypothesis"
    ) from e

from qcomm.kernels.wire_format import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    ROUNDING_MODES,
    SUPPORTED_BITS,
    QuantSpec,
)
from qcomm.validation import check_instance, check_int

__all__ = [
    "FLOAT_DTYPES",
    "KINDS",
    "NONFINITE_KINDS",
    "adversarial_tensors",
    "block_sizes",
    "float_dtypes",
    "lengths",
    "quant_specs",
    "seeds",
]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

#: Finite block kinds, in shrinking order (hypothesis shrinks towards the first).
KINDS: tuple[str, ...] = (
    "normal",       # Gaussian with a random magnitude over the dtype's range; a few +-0
    "zeros",        # all +0.0 (scale 0)
    "signed_zero",  # +0.0 and -0.0 mixed (sign of zero must not leak into codes)
    "subnormal",    # exact subnormals of the dtype (fp32 tensors also get fp16/bf16 ones)
    "huge",         # near the dtype's max, the max itself, 1e30 and 65504 where representable
    "tiny",         # 1e-30 (fp16: just above its smallest normal)
    "outlier",      # Gaussian block with one element 1e2..1e6 times larger
    "constant",     # every element equal (absmax = every |v|: level L everywhere)
    "ties",         # (k + 1/2) * 2**e and k * 2**e: exact rounding ties and exact levels
)
#: Kinds only drawn with ``allow_nonfinite=True``: a block holding NaN, or +-Inf.
NONFINITE_KINDS: tuple[str, ...] = ("nan", "inf")

# (smallest subnormal exponent, mantissa bits): the subnormals of a dtype are k * 2**exp for
# integers 0 < k < 2**mant.
_SUBNORMAL = {torch.float32: (-149, 23), torch.float16: (-24, 10), torch.bfloat16: (-133, 7)}


def float_dtypes() -> SearchStrategy[torch.dtype]:
    """One of float32, float16, bfloat16."""
    return st.sampled_from(FLOAT_DTYPES)


def block_sizes(min_size: int = MIN_BLOCK_SIZE, max_size: int = 256) -> SearchStrategy[int]:
    """Powers of two in ``[min_size, max_size]`` (defaults keep CPU tests fast; the wire format
    allows up to 4096), smallest first."""
    sizes = [1 << k for k in range(16) if min_size <= (1 << k) <= min(max_size, MAX_BLOCK_SIZE)]
    if not sizes:
        raise ValueError(f"no power of two in [{min_size}, {max_size}]")
    return st.sampled_from(sizes)


def _subset(name: str, given: Sequence, allowed: tuple) -> tuple:
    """``given`` as a tuple when it is a non-empty subset of ``allowed``, else ValueError."""
    given = tuple(given)
    if not given or any(g not in allowed for g in given):
        raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {list(given)}")
    return given


def quant_specs(
    bits: Sequence[int] = SUPPORTED_BITS,
    block_size: SearchStrategy[int] | int | None = None,
    rounding: Sequence[str] = ROUNDING_MODES,
) -> SearchStrategy[QuantSpec]:
    """:class:`~qcomm.kernels.wire_format.QuantSpec` values.

    Args:
        bits: code widths to draw from.
        block_size: a fixed block size, a strategy, or None for :func:`block_sizes`.
        rounding: rounding modes to draw from.
    """
    bits = _subset("bits", bits, SUPPORTED_BITS)
    rounding = _subset("rounding", rounding, ROUNDING_MODES)
    if isinstance(block_size, int):
        QuantSpec(bits[0], block_size)   # a block size the codec refuses, refused now
    if block_size is None:
        bs: SearchStrategy[int] = block_sizes()
    elif isinstance(block_size, int):
        bs = st.just(block_size)
    else:
        bs = block_size
    return st.builds(QuantSpec, bits=st.sampled_from(bits), block_size=bs,
                     rounding=st.sampled_from(rounding))


def lengths(block_size: int, max_blocks: int = 8) -> SearchStrategy[int]:
    """Element counts in ``[0, max_blocks * block_size]``, biased to the edges of blocks.

    Half of the draws come from 0, 1, 2, 3, block-1, block, block+1 and the multiples
    ``k * block`` and ``k * block +- 1`` (the lengths where padding, partial last blocks and
    the 4-byte alignment of the scales go wrong); the other half are uniform.
    """
    block_size = check_int("block_size", block_size, low=1)
    top = check_int("max_blocks", max_blocks, low=0) * block_size
    edges = {0, 1, 2, 3}
    for k in range(1, max_blocks + 1):
        edges |= {k * block_size - 1, k * block_size, k * block_size + 1}
    edge_list = sorted(e for e in edges if 0 <= e <= top)
    return st.one_of(st.sampled_from(edge_list), st.integers(0, top))


def seeds() -> SearchStrategy[int]:
    """Stochastic-rounding seeds over the whole range ``[0, 2**64)``, edges included."""
    return st.one_of(st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1]),
                     st.integers(0, 2**64 - 1))


# ---------------------------------------------------------------------------------------------
# adversarial tensors


def _subnormals(rng: np.random.Generator, m: int, dtype: torch.dtype) -> np.ndarray:
    """float64 [m] exact subnormals of ``dtype`` (fp32 also gets fp16 and bf16 subnormals,
    which are normal resp. subnormal fp32 values on the grid of the smaller type)."""
    choices = [dtype] if dtype != torch.float32 else list(_SUBNORMAL)
    which = rng.integers(0, len(choices), m)
    out = np.empty(m)
    for j, dt in enumerate(choices):
        exp, mant = _SUBNORMAL[dt]
        sel = which == j
        k = rng.integers(1, 1 << mant, int(sel.sum()))
        out[sel] = np.ldexp(k.astype(np.float64), exp)
    return out * rng.choice([-1.0, 1.0], m)


def _block_values(kind: str, rng: np.random.Generator, m: int, dtype: torch.dtype,
                  fmax: float, ftiny: float) -> np.ndarray:
    """float64 [m] values of one block; every value is finite and representable-or-rounded
    within ``dtype``'s finite range (|value| <= fmax), except for the non-finite kinds."""
    lo_exp, hi_exp = np.log10(ftiny) + 2, np.log10(fmax) - 2
    sign = rng.choice([-1.0, 1.0], m)
    if kind == "normal":
        vals = rng.standard_normal(m) * 10.0 ** rng.uniform(lo_exp, hi_exp)
        vals[rng.random(m) < 0.05] = -0.0  # an occasional (negative) zero inside a block
        return vals
    if kind == "zeros":
        return np.zeros(m)
    if kind == "signed_zero":
        return np.zeros(m) * sign
    if kind == "subnormal":
        return _subnormals(rng, m, dtype)
    if kind == "huge":
        pool = [fmax * rng.uniform(0.5, 1.0, m), np.full(m, fmax)]
        if fmax > 1e30:  # fp32 / bf16: also 1e30 and fp16's max, both far inside the range
            pool += [1e30 * rng.uniform(1.0, 10.0, m), np.full(m, 65504.0)]
        pick = rng.integers(0, len(pool), m)
        return np.choose(pick, pool) * sign
    if kind == "tiny":
        base = 1e-30 if ftiny < 1e-30 else ftiny
        return base * rng.uniform(1.0, 10.0, m) * sign
    if kind == "outlier":
        # fp16 spans only ~5 decades between its smallest normal and its max: cap the ratio
        ratio_exp = rng.uniform(2.0, min(6.0, hi_exp - lo_exp))
        mag = 10.0 ** rng.uniform(lo_exp, hi_exp - ratio_exp)
        vals = rng.standard_normal(m) * mag
        vals[rng.integers(0, m)] = sign[0] * mag * 10.0**ratio_exp
        return vals
    if kind == "constant":
        return np.full(m, sign[0] * 10.0 ** rng.uniform(lo_exp, hi_exp))
    if kind == "ties":
        # Small integers (and half-integers) times a power of two: exact in bf16 too; with
        # absmax 8 * 2**e a 4-bit block puts many values exactly halfway between levels.
        k = rng.integers(-8, 9, m) + 0.5 * rng.integers(0, 2, m)
        e = int(rng.integers(int(np.log2(ftiny)) + 4, int(np.log2(fmax)) - 4))
        return np.ldexp(k, e)
    if kind in NONFINITE_KINDS:
        vals = rng.standard_normal(m)
        bad = rng.random(m) < 0.1
        bad[rng.integers(0, m)] = True  # at least one
        vals[bad] = np.nan if kind == "nan" else np.inf * sign[bad]
        return vals
    raise ValueError(f"unknown block kind {kind!r}; allowed: {KINDS + NONFINITE_KINDS}")


@st.composite
def _adversarial(draw: st.DrawFn, n: int | SearchStrategy[int],
                 dtype: torch.dtype | SearchStrategy[torch.dtype], block_size: int,
                 kinds: tuple[str, ...], allow_nonfinite: bool) -> torch.Tensor:
    numel = n if isinstance(n, int) else draw(n)
    dt = dtype if isinstance(dtype, torch.dtype) else draw(dtype)
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dt}")
    pool = kinds + (NONFINITE_KINDS if allow_nonfinite else ())
    nblocks = -(-numel // block_size)
    # A third of the tensors are one kind throughout (a whole tensor of subnormals, of
    # huge values, ...); the rest mix kinds block by block.
    if draw(st.integers(0, 2)) == 0:
        block_kinds = [draw(st.sampled_from(pool))] * nblocks
    else:
        block_kinds = draw(st.lists(st.sampled_from(pool), min_size=nblocks, max_size=nblocks))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    fi = torch.finfo(dt)
    vals = np.empty(numel, dtype=np.float64)
    for b, kind in enumerate(block_kinds):
        lo, hi = b * block_size, min(numel, (b + 1) * block_size)
        vals[lo:hi] = _block_values(kind, rng, hi - lo, dt, float(fi.max), float(fi.tiny))
    # float64 -> dtype in one rounding; |values| <= finfo.max cannot round to infinity.
    t = torch.from_numpy(vals).to(dt)
    if not allow_nonfinite:
        assert bool(torch.isfinite(t).all()), "strategy bug: non-finite value drawn"
    return t


def adversarial_tensors(
    n: int | SearchStrategy[int],
    *,
    dtype: torch.dtype | SearchStrategy[torch.dtype] | None = None,
    block_size: int = 128,
    kinds: Sequence[str] = KINDS,
    allow_nonfinite: bool = False,
) -> SearchStrategy[torch.Tensor]:
    """1-D contiguous CPU tensors of ``n`` elements that stress a per-block codec.

    Args:
        n: the number of elements, or a strategy for it (e.g. :func:`lengths`).
        dtype: float32/float16/bfloat16, a strategy of them, or None for all three.
        block_size: the codec's block size: each block of this many elements gets one kind
            (the last block may be partial), so block-local effects line up with the codec's.
        kinds: the finite kinds to draw from (subset of :data:`KINDS`), e.g. without
            ``"huge"`` where ``x + error`` must not overflow.
        allow_nonfinite: also draw blocks holding NaN or +-Inf (:data:`NONFINITE_KINDS`).
            Without it every value is finite.

    Returns:
        Strategy of tensors of dtype ``dtype`` and shape ``[n]``.
    """
    kinds = _subset("kinds", kinds, KINDS)
    if not isinstance(n, SearchStrategy):
        check_int("n", n, low=0, what="an int >= 0 or a strategy of them")
    check_int("block_size", block_size, low=1)
    check_instance("allow_nonfinite", allow_nonfinite, bool, what="True or False")
    return _adversarial(n, float_dtypes() if dtype is None else dtype, block_size,
                        kinds, allow_nonfinite)
