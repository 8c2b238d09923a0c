"""Counter-based random numbers for stochastic rounding, in pure torch.

The Triton kernels compute the very same function with native uint32 arithmetic
(:func:`qcomm.kernels.triton_codec`), so the same seed gives the same payload bytes on every
device. Here uint32 arithmetic runs on int32 tensors holding the same 32 bits (torch has no full
uint32 arithmetic on CPU): xor, add and multiply are identical bit for bit in two's complement
(torch's int32 products wrap modulo 2**32, checked against numpy's uint32 in the tests); a
logical right shift is an arithmetic shift with the sign-extended bits masked off. This is the
stochastic-rounding hot spot of the CPU path, so it stays in 4-byte integers throughout.

Definition (all arithmetic modulo 2**32)::

    mix32(h):  h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16
    key(seed, hi) = mix32(seed_lo ^ mix32(seed_hi ^ mix32(hi ^ 0x9E3779B9)))
    bits(i)       = mix32(mix32(lo ^ key) + key)       where lo, hi = i mod 2**32, i >> 32
    uniform(i)    = (bits(i) >> 8) * 2**-24             in [0, 1), exact in float32

``mix32`` is Chris Wellons' "lowbias32" integer hash: a bijection on 32-bit words with strong
avalanche. ``key`` (:func:`qcomm.seeds.stream_key`, the last level of qcomm's seed derivation
tree) depends only on the seed and the top half of the element index, so a kernel computes it
once per program (a program never straddles a 2**32 boundary).
"""

from __future__ import annotations

import torch

# One source for the hash: the constants and the host-side key live with the rest of the seed
# derivation tree (qcomm.seeds); the Triton kernels import them from there too.
from qcomm.seeds import MASK32, MIX_MUL_1, MIX_MUL_2, stream_key

__all__ = ["mix32", "stream_key", "uniform"]


def _signed32(const: int) -> int:
    """The int32 whose bits are the uint32 ``const``."""
    return const - (1 << 32) if const >= 1 << 31 else const


def _shr32(h: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of the uint32 held in int32 ``h``."""
    return (h >> k) & ((1 << (32 - k)) - 1)


def mix32(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors holding uint32 bits (returns int32)."""
    h = h ^ _shr32(h, 16)
    h = h * _signed32(MIX_MUL_1)
    h = h ^ _shr32(h, 15)
    h = h * _signed32(MIX_MUL_2)
    return h ^ _shr32(h, 16)


def uniform(seed: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[count]`` uniforms in [0, 1) for element indices ``start .. start+count-1``."""
    end = start + count
    out = torch.empty(count, dtype=torch.float32, device=device)
    pos = 0
    while pos < count:  # one pass per 2**32-aligned span (one key each); almost always one
        first = start + pos
        hi = first >> 32
        stop = min(end, (hi + 1) << 32)
        lo = _lo_indices(first & MASK32, stop - first, device)
        key = _signed32(stream_key(seed, hi))
        h = mix32(mix32(lo ^ key) + key)
        out[pos:pos + stop - first] = _shr32(h, 8).to(torch.float32) * (2.0**-24)
        pos += stop - first
    return out


def _lo_indices(first: int, count: int, device: torch.device | str) -> torch.Tensor:
    """int32 tensor of the uint32 values first .. first+count-1 (no wrap: a span never crosses
    2**32)."""
    if first + count <= 1 << 31:
        return torch.arange(first, first + count, dtype=torch.int32, device=device)
    return torch.arange(first, first + count, dtype=torch.int64, device=device).to(torch.int32)

