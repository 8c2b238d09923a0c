"""The public functions' argument checks: each names the argument and what is allowed.

A payload of the wrong length says which other specs its length fits (a payload made with
another spec is the usual cause). Callers that checked once for many calls skip these and
call :mod:`.unchecked`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.kernels.wire_format import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    SUPPORTED_BITS,
    QuantSpec,
    packed_nbytes,
)
from qcomm.seeds import draw_seed
from qcomm.validation import check_seed, check_tensor

__all__ = ["check_buffer", "check_float_tensor", "check_out", "check_payload_tensor",
           "check_payloads", "flat", "overlap", "resolve_seed"]


def check_float_tensor(t: object, name: str, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    return check_tensor(name, t, dtypes=dtypes)


def check_buffer(buf: object, name: str, like: torch.Tensor) -> torch.Tensor:
    """An fp32 buffer with ``like``'s numel and device, contiguous (written in place)."""
    buf = check_tensor(name, buf, dtypes=(torch.float32,))
    if buf.numel() != like.numel():
        raise ValueError(f"{name} must have numel {like.numel()} (like x), got {buf.numel()}")
    if buf.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like x), got {buf.device}")
    return check_tensor(name, buf, contiguous=True, why="it is updated in place")


def check_out(out: torch.Tensor | None, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """:func:`quantize`'s ``out``, checked against ``x`` (a new payload when None)."""
    if out is None:
        return torch.empty(packed_nbytes(x.numel(), spec), dtype=torch.uint8, device=x.device)
    out = check_payload_tensor(out, "out", x.numel(), spec, ndim=1)
    if out.device != x.device:
        raise ValueError(f"out must be on {x.device} (like x), got {out.device}")
    return out


def check_payloads(payloads: object, out: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """:func:`dequant_accumulate`'s ``payloads`` as uint8 ``[K, nbytes]`` on out's device."""
    if isinstance(payloads, torch.Tensor) and payloads.dim() == 1:
        payloads = payloads.unsqueeze(0)
    payloads = check_payload_tensor(payloads, "payloads", out.numel(), spec, ndim=2)
    if payloads.device != out.device:
        raise ValueError(f"payloads must be on {out.device} (like out), got {payloads.device}")
    return payloads


def check_payload_tensor(p: object, name: str, numel: int, spec: QuantSpec,
                          ndim: int) -> torch.Tensor:
    p = check_tensor(name, p, dtypes=(torch.uint8,))
    if p.dim() != ndim:
        shape = "[nbytes]" if ndim == 1 else "[K, nbytes]"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(p.shape)}")
    if p.shape[-1] != packed_nbytes(numel, spec):
        raise ValueError(_length_mismatch(name, p.shape[-1], numel, spec))
    return check_tensor(name, p, contiguous=True)


def _fitting_specs(nbytes: int, numel: int, spec: QuantSpec) -> list[str]:
    """The other (bits, block_size) under which ``numel`` values take ``nbytes`` bytes."""
    out = []
    for bits in SUPPORTED_BITS:
        bs = MIN_BLOCK_SIZE
        while bs <= MAX_BLOCK_SIZE:
            if (bits, bs) != (spec.bits, spec.block_size) and packed_nbytes(
                    numel, QuantSpec(bits, bs, spec.rounding)) == nbytes:
                out.append(f"bits={bits}, block_size={bs}")
            bs *= 2
    return out


def _length_mismatch(name: str, nbytes: int, numel: int, spec: QuantSpec) -> str:
    """Why a payload of ``nbytes`` bytes is not one of ``numel`` values under ``spec``: the
    lengths, and the specs the length would fit (a payload made with another spec is the
    usual cause), or that it fits none (a truncated or foreign buffer)."""
    want = packed_nbytes(numel, spec)
    head = (f"{name} must be packed_nbytes({numel}, spec) = {want} bytes per message for "
            f"{numel} values with bits={spec.bits}, block_size={spec.block_size}, got {nbytes}")
    fits = _fitting_specs(nbytes, numel, spec)
    if fits:
        return f"{head}; {nbytes} bytes fit {numel} values under {' or '.join(fits)}: was it " \
               f"quantized with another spec?"
    return f"{head}; the payload does not match this spec (numel, bits, block size) nor any " \
           f"other spec for {numel} values: a truncated or foreign buffer?"


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def resolve_seed(seed: int | None, spec: QuantSpec) -> int:
    if seed is None:
        if spec.rounding == "nearest":
            return 0
        # Drawn from torch's default generator, so torch.manual_seed makes runs reproducible.
        return draw_seed()
    return check_seed(seed)


def flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous tensor as 1-D (itself when it is: a view costs the host a microsecond)."""
    return t if t is None or t.dim() == 1 else t.view(-1)
