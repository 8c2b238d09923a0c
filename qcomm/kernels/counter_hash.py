"""Counter-based random numbers for stochastic rounding, in pure torch.

The Triton kernels compute the very same function with native uint32 arithmetic
(:func:`qcomm.kernels.triton_codec`), so the same seed gives the same payload bytes on every
device. Here uint32 arithmetic is emulated in int64 (torch has no full uint32 arithmetic on CPU);
products are split into 16-bit halves so no intermediate leaves int64's range.

Definition (all arithmetic modulo 2**32)::

    mix32(h):  h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16
    key(seed, hi) = mix32(seed_lo ^ mix32(seed_hi ^ mix32(hi ^ 0x9E3779B9)))
    bits(i)       = mix32(mix32(lo ^ key) + key)       where lo, hi = i mod 2**32, i >> 32
    uniform(i)    = (bits(i) >> 8) * 2**-24             in [0, 1), exact in float32

``mix32`` is Chris Wellons' "lowbias32" integer hash: a bijection on 32-bit words with strong
avalanche. ``key`` depends only on the seed and the top half of the element index, so a kernel
computes it once per program (a program never straddles a 2**32 boundary).
"""

from __future__ import annotations

import operator

import torch

MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B
HI_SALT = 0x9E3779B9
MASK32 = 0xFFFFFFFF
SEED_MAX = (1 << 64) - 1


def _mul32(h: torch.Tensor, const: int) -> torch.Tensor:
    """(h * const) mod 2**32 for int64 h in [0, 2**32), without int64 overflow."""
    lo = h * (const & 0xFFFF)
    hi = ((h * (const >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, MIX_MUL_1)
    h = h ^ (h >> 15)
    h = _mul32(h, MIX_MUL_2)
    return h ^ (h >> 16)


def mix32_int(h: int) -> int:
    """lowbias32 on a Python int (for per-message keys computed on the host)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * MIX_MUL_1) & MASK32
    h ^= h >> 15
    h = (h * MIX_MUL_2) & MASK32
    return h ^ (h >> 16)


def stream_key(seed: int, hi: int) -> int:
    """The 32-bit key for elements whose index has top half ``hi``."""
    return mix32_int((seed & MASK32) ^ mix32_int(((seed >> 32) & MASK32) ^ mix32_int(hi ^ HI_SALT)))


def check_seed(seed: int) -> int:
    """``seed`` as a Python int in [0, 2**64); numpy and torch integer scalars are accepted."""
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}") from None
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def uniform(seed: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[count]`` uniforms in [0, 1) for element indices ``start .. start+count-1``."""
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
    lo = idx & MASK32
    hi = idx >> 32
    if count == 0 or int(hi[0]) == int(hi[-1]):
        key = torch.tensor(stream_key(seed, int(hi[0]) if count else 0), dtype=torch.int64,
                           device=device)
    else:  # a range crossing a 2**32 boundary: one key per element (rare, correctness only)
        keys = [stream_key(seed, int(h)) for h in range(int(hi[0]), int(hi[-1]) + 1)]
        key = torch.tensor(keys, dtype=torch.int64, device=device)[hi - hi[0]]
    h = mix32((mix32(lo ^ key) + key) & MASK32)
    return (h >> 8).to(torch.float32) * (2.0**-24)
