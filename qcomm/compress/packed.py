"""One quantized message: its payload (the bytes on the wire) and what decoding it needs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qcomm.kernels.wire_format import QuantSpec, payload_scales

from .arguments import check_payload_tensor
from .verdict import DeferredCheck

__all__ = ["Packed"]


@dataclass(frozen=True)
class Packed:
    """One quantized message.

    Attributes:
        payload: uint8 ``[packed_nbytes(numel, spec)]``, codes then scales; what goes on the wire.
        numel: number of values encoded.
        spec: the QuantSpec used.
        shape: shape of the original tensor (dequantize restores it).
        dtype: dtype of the original tensor (dequantize's default output dtype).
        deferred: the finiteness check that a ``non_blocking`` :func:`quantize` left for
            :meth:`wait`, or None (checked when made, or received).
    """

    payload: torch.Tensor
    numel: int
    spec: QuantSpec
    shape: torch.Size
    dtype: torch.dtype
    deferred: DeferredCheck | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_payload_tensor(self.payload, "payload", self.numel, self.spec, ndim=1)
        if any(d < 0 for d in self.shape) or math.prod(self.shape) != self.numel:
            raise ValueError(f"shape must have numel {self.numel} (the payload's), got "
                             f"{tuple(self.shape)}")

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    @property
    def scales(self) -> torch.Tensor:
        """float32 ``[nblocks]`` view of the payload's scales."""
        return payload_scales(self.payload, self.numel, self.spec)

    def wait(self) -> Packed:
        """This Packed once its deferred check passed (one host read; nothing to do when it has
        none): raises :class:`NonFiniteError` when the input of a ``non_blocking``
        :func:`quantize` held NaN or Inf, as the blocking call would have."""
        if self.deferred is not None:
            self.deferred.wait()
        return self

    @classmethod
    def _unchecked(cls, payload: torch.Tensor, numel: int, spec: QuantSpec, shape: torch.Size,
                   dtype: torch.dtype, deferred: DeferredCheck | None = None) -> Packed:
        """A Packed whose fields the caller has already checked (the codec's own output):
        without :meth:`__post_init__`'s checks, which would re-prove them on every call."""
        packed = object.__new__(cls)
        # the fields straight into the instance's dict: a frozen dataclass's setattr refuses
        packed.__dict__.update(payload=payload, numel=numel, spec=spec, shape=shape,
                               dtype=dtype, deferred=deferred)
        return packed

    @classmethod
    def from_payload(cls, payload: torch.Tensor, numel: int, spec: QuantSpec,
                     shape: Sequence[int] | None = None,
                     dtype: torch.dtype = torch.float32) -> Packed:
        """Wrap a received payload (uint8 ``[packed_nbytes(numel, spec)]``); ``shape`` (default
        ``(numel,)``) must have ``numel`` elements (ValueError otherwise)."""
        return cls(payload, numel, spec, torch.Size(shape if shape is not None else (numel,)),
                   dtype)
