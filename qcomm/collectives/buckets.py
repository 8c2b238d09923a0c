"""Flat buckets over a list of tensors: cut the list into contiguous 1-D pieces of bounded size.

The tensors of one dtype are read as one flat stream (tensor 0's elements, then tensor 1's, ...;
empty tensors contribute nothing) and the stream is cut every ``capacity`` elements, so every
bucket but the last of a dtype is exactly full and a tensor larger than a bucket simply spans
several. A bucket is a list of segments ``(tensor index, start, length)`` into the tensors' flat
views; :func:`pack` copies them into one flat buffer and :func:`unpack` copies a buffer back.

Tensors of different dtypes go to different buckets (in order of each dtype's first appearance),
since one buffer has one dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "Segment", "check_tensors", "layout_key", "pack", "plan_buckets", "unpack"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + length)`` of ``tensors[index].view(-1)``."""

    index: int
    start: int
    length: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer's worth of elements of a single dtype."""

    dtype: torch.dtype
    numel: int
    segments: tuple[Segment, ...]


def check_tensors(tensors: object, dtypes: Sequence[torch.dtype],
                  name: str = "tensors") -> list[torch.Tensor]:
    """Validate a sequence of tensors averaged in place: each a torch.Tensor of an allowed dtype,
    contiguous, all on one device. Returns them as a list.

    Raises:
        TypeError: not a sequence of tensors, or a dtype outside ``dtypes``.
        ValueError: a non-contiguous tensor, or tensors on different devices.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a sequence (list/tuple) of torch.Tensor, "
                        f"got {type(tensors).__name__}")
    out = list(tensors)
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}[{i}] must have dtype in ({allowed}), got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous (it is updated in place through "
                             f"a flat view)")
        if t.device != out[0].device:
            raise ValueError(f"{name} must all be on one device: {name}[0] is on "
                             f"{out[0].device}, {name}[{i}] on {t.device}")
    return out


def plan_buckets(tensors: Sequence[torch.Tensor], capacity_bytes: int) -> list[Bucket]:
    """Cut ``tensors`` into flat buckets of at most ``capacity_bytes`` bytes each (at least one
    element per bucket). Pure function of the tensors' numels and dtypes.

    Args:
        tensors: tensors of any shape (flattened row-major).
        capacity_bytes: bucket size in bytes (> 0).

    Returns:
        Buckets in order: grouped by dtype (first appearance), then by position in the stream.
    """
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
    dtypes: list[torch.dtype] = []
    for t in tensors:
        if t.dtype not in dtypes:
            dtypes.append(t.dtype)
    buckets: list[Bucket] = []
    for dtype in dtypes:
        capacity = max(1, capacity_bytes // torch.empty(0, dtype=dtype).element_size())
        segments: list[Segment] = []
        filled = 0
        for index, t in enumerate(tensors):
            if t.dtype != dtype:
                continue
            start, n = 0, t.numel()
            while start < n:
                take = min(n - start, capacity - filled)
                segments.append(Segment(index, start, take))
                start += take
                filled += take
                if filled == capacity:
                    buckets.append(Bucket(dtype, filled, tuple(segments)))
                    segments, filled = [], 0
        if filled:
            buckets.append(Bucket(dtype, filled, tuple(segments)))
    return buckets


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's segments into ``out[:bucket.numel]`` (``out``: flat, any float dtype;
    elements past ``numel`` are left as they are). Returns ``out``."""
    offset = 0
    for seg in bucket.segments:
        src = tensors[seg.index].detach().view(-1)[seg.start:seg.start + seg.length]
        out[offset:offset + seg.length].copy_(src)
        offset += seg.length
    return out


def unpack(bucket: Bucket, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat[:bucket.numel]`` back into the tensors' segments (casting to their dtype)."""
    offset = 0
    with torch.no_grad():
        for seg in bucket.segments:
            dst = tensors[seg.index].view(-1)[seg.start:seg.start + seg.length]
            dst.copy_(flat[offset:offset + seg.length])
            offset += seg.length


def layout_key(tensors: Sequence[torch.Tensor], capacity_bytes: int) -> str:
    """A short stable string naming the layout (shapes, dtypes, bucket size): the default key of
    error-feedback state, so calls with the same layout share residuals across steps."""
    h = hashlib.sha1(repr(capacity_bytes).encode())
    for t in tensors:
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    return "L" + h.hexdigest()[:16]
