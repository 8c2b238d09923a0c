"""The steps every collective of this package is built from, and the one place that talks to
``torch.distributed``'s collectives.

Each function takes a ``group``: a ``torch.distributed`` process group (or None for the default
group), or a :class:`~qcomm.collectives.memory.MemoryGroup` (ranks as threads of one process, for
tests and simulations); the dispatch between the two happens here and nowhere else.

* wrappers: :func:`all_reduce`, :func:`all_gather_flat`, :func:`all_to_all_single`;
* pipeline steps used by the bucketed means (:mod:`.intra`, :mod:`.hierarchical`):
  :func:`start_reduce_scatter`, :func:`start_all_gather`, :func:`quantize_or_poison`,
  :func:`decode_mean`, with :func:`acc_dtype` and :func:`derive_seed`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qcomm.collectives.memory import MemoryGroup
from qcomm.collectives.stats import CommStats
from qcomm.compress import ErrorFeedback, NonFiniteError, QuantSpec, dequant_accumulate

__all__ = ["acc_dtype", "all_gather_flat", "all_reduce", "all_to_all_single", "decode_mean",
           "derive_seed", "group_size", "quantize_or_poison", "start_all_gather",
           "start_reduce_scatter"]

# torch 2.13 renames the flat collectives (same signatures) and warns on the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_MASK64 = (1 << 64) - 1
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ---------------------------------------------------------------------------------------------
# wrappers: one call for process groups and in-memory groups


def group_size(group: Any) -> int:
    """Number of members of ``group``."""
    if isinstance(group, MemoryGroup):
        return group.size
    return dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum") -> None:
    """Reduce ``tensor`` in place over ``group`` (``op``: ``"sum"``, ``"max"`` or ``"min"``),
    blocking."""
    if isinstance(group, MemoryGroup):
        group.all_reduce(tensor, op)
        return
    dist.all_reduce(tensor, op=_DIST_OPS[op], group=group)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, *,
                    async_op: bool = False) -> Any:
    """``out`` (flat, ``size * inp.numel()``) = every member's ``inp`` by group rank. Returns the
    work when ``async_op``."""
    if isinstance(group, MemoryGroup):
        return group.all_gather(out, inp)
    return _all_gather_flat(out, inp, group=group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group: Any, *,
                      async_op: bool = False) -> Any:
    """Equal-split all-to-all: chunk k of ``out`` = chunk ``my rank`` of member k's ``inp``."""
    if isinstance(group, MemoryGroup):
        return group.all_to_all_single(out, inp)
    return dist.all_to_all_single(out, inp, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------------------
# pipeline steps

# ---------------------------------------------------------------------------------------------


def derive_seed(base: int, *parts: int) -> int:
    """A 64-bit seed from ``base`` and a few ints (splitmix64 chain): distinct streams per rank,
    call and bucket, so ranks' stochastic roundings are independent."""

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    x = mix(base & _MASK64)
    for p in parts:
        x = mix(x ^ mix(p & _MASK64))
    return x


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype sums are accumulated in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _native_reduce_scatter(group: Any, device: torch.device) -> bool:
    if isinstance(group, MemoryGroup):
        return False
    return device.type == "cuda" and "cuda:nccl" in dist.get_backend_config(group)


def start_reduce_scatter(buf: torch.Tensor, group: Any, size: int, stats: CommStats,
                         level: str) -> tuple[Any, Any]:
    """Start summing ``buf`` (flat ``[size * c]``, wire dtype) over ``group``: rank i gets the
    sum of everyone's chunk i. Returns (work, result) where ``result()``, called after the work
    completed, gives that sum as a new ``[c]`` tensor in :func:`acc_dtype`."""
    c = buf.numel() // size
    stats.record(level, (size - 1) * c * buf.element_size(), size - 1)
    acc = acc_dtype(buf.dtype)
    if _native_reduce_scatter(group, buf.device):
        out = torch.empty(c, dtype=buf.dtype, device=buf.device)
        work = _reduce_scatter_flat(out, buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return work, lambda: out.to(acc)
    # Gloo: its reduce-scatter would all-reduce the whole buffer; all-to-all moves (size-1)/size
    # of it, and the sum of the received chunks (by source rank, in acc dtype) is done here.
    recv = torch.empty_like(buf)
    work = all_to_all_single(recv, buf, group, async_op=True)
    return work, lambda: recv.view(size, c).sum(dim=0, dtype=acc)


def start_all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, size: int,
                     stats: CommStats, level: str) -> Any:
    """Start ``out = cat(every member's shard)`` (flat, by group rank). Returns the work."""
    stats.record(level, (size - 1) * shard.numel() * shard.element_size(), size - 1)
    return all_gather_flat(out, shard, group, async_op=True)


def quantize_or_poison(ef: ErrorFeedback, key: str, x: torch.Tensor, spec: QuantSpec, seed: int,
                       out: torch.Tensor) -> NonFiniteError | None:
    """Quantize ``x`` with error feedback into ``out``. On non-finite input return the error
    instead of raising: ``out`` then holds NaN scales and is sent anyway, so every peer's
    decode raises too and all ranks finish the same collectives (no rank is left hanging); the
    residual is unchanged (ErrorFeedback guarantees it)."""
    try:
        ef.quantize(key, x, spec, seed=seed, out=out)
    except NonFiniteError as e:
        return e
    return None


def decode_mean(payloads: torch.Tensor, out: torch.Tensor,
                spec: QuantSpec) -> NonFiniteError | None:
    """``out += mean_k D(payloads[k])``; on a non-finite payload fill ``out`` with NaN and return
    the error (raised by the handle once every collective finished)."""
    k = payloads.shape[0]
    try:
        dequant_accumulate(payloads, out, spec, weights=[1.0 / k] * k)
    except NonFiniteError as e:
        out.fill_(float("nan"))
        return e
    return None


