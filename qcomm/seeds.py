"""Every random stream of qcomm comes from one seed, through one derivation tree: this module.

Stochastic rounding needs random numbers that are reproducible and independent between
messages, so every message gets its own 64-bit *message seed*, derived from the user's seed and
the message's coordinates, and the codec draws element ``i``'s number from ``(message seed, i)``
(why, and why the hashes are three: docs/design.md, "The seed tree")::

    seed S  (CommOptions.seed, HierarchicalQuantState(seed=...), ...: an int in [0, 2**64))
    │
    ├── intra-node mean and hierarchical allreduce (qcomm.collectives.intra, .hierarchical)
    │     message seed = derive(S, rank, call, bucket)                      splitmix64 chain
    │
    ├── gossip, rail of local rank l (qcomm.engine)
    │     rail seed R = rail_seed(S, l) = (S * 1_000_003 + l) mod 2**63
    │     └── message of round t from member m (qcomm.collectives.gossip.choco)
    │           message seed = gossip_message_seed(R, t, m)                 blake2b-64
    │
    ├── quantize(x, spec, seed=None): message seed = draw_seed(), one draw from torch's
    │     default generator (so torch.manual_seed makes a script reproducible)
    │
    └── inside the codec, element i of a message with seed M (qcomm.kernels.counter_hash,
          and the Triton kernels, which compute the same function on the device):
          key  = stream_key(M, i >> 32)                                     lowbias32 chain
          bits = mix32(mix32((i mod 2**32) ^ key) + key);  uniform = (bits >> 8) * 2**-24

The hashes are kept as they are (checkpoints hold rounds quantized with these streams).
:func:`seal_key` keys a gossip message's seal: a key, not a random stream.
"""

from __future__ import annotations

import hashlib

import torch

from qcomm.validation import check_seed

__all__ = ["DRAW_BOUND", "HI_SALT", "MASK32", "MIX_MUL_1", "MIX_MUL_2", "derive", "draw_seed",
           "fmix64", "gossip_message_seed", "mix32", "rail_seed", "seal_key", "stream_key"]

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1

# lowbias32 (the codec's element-level hash; the Triton kernels import these very constants)
MIX_MUL_1 = 0x7FEB352D
MIX_MUL_2 = 0x846CA68B
HI_SALT = 0x9E3779B9  # mixed into the top half of the element index

# splitmix64
GOLDEN_64 = 0x9E3779B97F4A7C15
_FMIX_MUL_1 = 0xBF58476D1CE4E5B9
_FMIX_MUL_2 = 0x94D049BB133111EB
_SEAL_MUL_SENDER = 0xD1B54A32D192ED03
_SEAL_ADD = 0x632BE59BD9B4E019

RAIL_MUL = 1_000_003
DRAW_BOUND = 1 << 62
"""draw_seed() draws from [0, 2**62)."""


# ---------------------------------------------------------------------------------------------
# mixers


def mix32(h: int) -> int:
    """lowbias32 of a 32-bit word (a Python int; the tensor form is
    :func:`qcomm.kernels.counter_hash.mix32`)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * MIX_MUL_1) & MASK32
    h ^= h >> 15
    h = (h * MIX_MUL_2) & MASK32
    return h ^ (h >> 16)


def fmix64(z: int) -> int:
    """The splitmix64 finalizer of a 64-bit word."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _FMIX_MUL_1) & MASK64
    z = ((z ^ (z >> 27)) * _FMIX_MUL_2) & MASK64
    return z ^ (z >> 31)


def _splitmix64(z: int) -> int:
    return fmix64(z + GOLDEN_64)


# ---------------------------------------------------------------------------------------------
# the tree, from the user's seed down


def derive(seed: int, *parts: int) -> int:
    """The message seed of a bucketed mean's message: 64 bits from ``seed`` and the message's
    coordinates (rank, call, bucket), a splitmix64 chain."""
    x = _splitmix64(seed & MASK64)
    for p in parts:
        x = _splitmix64(x ^ _splitmix64(p & MASK64))
    return x


def rail_seed(seed: int, local_rank: int) -> int:
    """The seed of the gossip on the rail of ``local_rank`` (rails gossip different shards, so
    they need different streams), in [0, 2**63)."""
    return (check_seed(seed) * RAIL_MUL + local_rank) % (1 << 63)


def gossip_message_seed(seed: int, round: int, member: int) -> int:
    """The message seed of ``member``'s gossip message of ``round``, from the gossip's seed."""
    h = hashlib.blake2b(f"qcomm-gossip:{seed}:{round}:{member}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def draw_seed() -> int:
    """A message seed drawn from torch's default generator (``quantize(seed=None)``)."""
    return int(torch.randint(0, DRAW_BOUND, (1,)).item())


def stream_key(seed: int, hi: int) -> int:
    """The codec's 32-bit key for the elements of a message (seed ``seed``) whose index has top
    half ``hi`` (``index >> 32``)."""
    return mix32((seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ mix32(hi ^ HI_SALT)))


def seal_key(round: int, sender: int) -> int:
    """The 64-bit key of a gossip message's seal, as a signed int64 value."""
    z = fmix64(round * GOLDEN_64 + sender * _SEAL_MUL_SENDER + _SEAL_ADD)
    return z - (1 << 64) if z >= 1 << 63 else z
