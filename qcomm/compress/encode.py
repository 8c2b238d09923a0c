"""Quantization into one payload, with optional fused error feedback: :func:`quantize`."""

from __future__ import annotations

from functools import partial

import torch

from qcomm.kernels.accumulate_guard import FLOAT32_MAX
from qcomm.kernels.wire_format import INPUT_DTYPES, QuantSpec, check_spec, payload_scales
from qcomm.validation import check_instance

from .arguments import check_buffer, check_float_tensor, check_out, flat, overlap, resolve_seed
from .errors import nonfinite_error
from .packed import Packed
from .unchecked import quantize_into
from .verdict import DeferredCheck, largest_magnitude, raise_if_nonfinite

__all__ = ["quantize", "quantize_checked"]


def quantize(x: torch.Tensor, spec: QuantSpec, *, error: torch.Tensor | None = None,
             error_out: torch.Tensor | None = None, seed: int | None = None,
             out: torch.Tensor | None = None, non_blocking: bool = False) -> Packed:
    """Quantize ``x`` into one payload, with optional fused error feedback.

    With ``error``: ``v = x + error``; ``payload = Q(v)``; the residual ``v - D(payload)`` goes
    to ``error_out`` if given (one pass over memory: reads x and error, writes payload and
    error_out; this is what :class:`ErrorFeedback` does with two buffers it swaps), else back
    into ``error`` in place. The in-place form writes the residual to a scratch buffer and copies
    it into ``error`` only after the input was found finite: one more pass over the residual,
    the price of leaving ``error`` untouched on :class:`NonFiniteError`.

    Args:
        x: float32/float16/bfloat16, any shape (flattened in row-major order), any numel.
        spec: the QuantSpec.
        error: float32 with ``x.numel()`` elements on x's device, or None.
        error_out: float32 like ``error``, receives the new residual; must not overlap ``error``
            (pass only ``error`` for in place). With ``error=None`` it receives ``x - D(payload)``.
        seed: int in [0, 2**64) for stochastic rounding; None draws one from torch's default
            generator. Same seed, same bytes on every backend. Ignored for nearest rounding.
        out: uint8 ``[packed_nbytes(x.numel(), spec)]`` on x's device to write the payload into.
        non_blocking: False (default): the finiteness check is read here (one host sync on an
            accelerator) and raises at once. True: it stays on the device and the call returns
            without a sync; :meth:`Packed.wait` reads it and raises the same error. Until then
            the payload may carry NaN scales (every decode refuses those, so it may be sent to
            peers that decode with this module, as qcomm's collectives do) and ``error_out``
            must not become a residual; the in-place ``error`` is updated on the device only
            if the check passes. The verdict is the call's; the error names the blocks from
            the payload as ``wait()`` finds it (none if ``out`` was overwritten since).

    Returns:
        Packed with ``payload`` uint8 ``[packed_nbytes(x.numel(), spec)]``.

    Raises:
        NonFiniteError: ``x + error`` holds NaN/Inf. ``error`` is unchanged, no Packed is
            returned, and ``out`` (if given) holds NaN scales and must not be sent. (With
            ``non_blocking``: from :meth:`Packed.wait`.)
        TypeError, ValueError: a bad argument (named in the message).
    """
    x = check_float_tensor(x, "x", INPUT_DTYPES)
    spec = check_spec(spec)
    if error is not None:
        error = check_buffer(error, "error", x)
    if error_out is not None:
        error_out = check_buffer(error_out, "error_out", x)
        if error is not None and overlap(error, error_out):
            raise ValueError("error_out must not overlap error; pass only error for in place")
    out = check_out(out, x, spec)
    check_instance("non_blocking", non_blocking, bool, what="True or False")
    return quantize_checked(x, spec, error, error_out, resolve_seed(seed, spec), out,
                             non_blocking)


def quantize_checked(x: torch.Tensor, spec: QuantSpec, error: torch.Tensor | None,
                      error_out: torch.Tensor | None, seed: int, out: torch.Tensor,
                      non_blocking: bool = False) -> Packed:
    """:func:`quantize` once its arguments passed its checks (or the caller's equivalent ones):
    the kernel, the finiteness check (one host read, or none with ``non_blocking``), the
    residual."""
    n = x.numel()
    values = x if x.dim() == 1 else x.reshape(-1)
    if not values.is_contiguous():
        values = values.contiguous()
    residual_out = error_out
    if error is not None and error_out is None:
        residual_out = torch.empty_like(error)  # scratch: error stays intact until we know
    quantize_into(values, spec, out, seed, flat(error), flat(residual_out))
    scales = payload_scales(out, n, spec)
    deferred = None
    if non_blocking:
        largest = largest_magnitude(scales) if n else None
        deferred = DeferredCheck(largest, partial(nonfinite_error, scales, "x",
                                                  "(plus error) has"))
        if largest is not None and error is not None and error_out is None:
            # the residual moves only if every scale is finite
            torch.where(largest <= FLOAT32_MAX, residual_out, error, out=error)
    else:
        raise_if_nonfinite(scales, "x", "(plus error) has")
        if error is not None and error_out is None:
            error.copy_(residual_out)
    return Packed._unchecked(out, n, spec, x.shape, x.dtype, deferred)
