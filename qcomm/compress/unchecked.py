"""The codec's kernels without any check: every call into a backend goes through here.

For the public functions once their checks passed, and for callers that checked their
arguments once for many calls (the gossip's rounds, whose buffers are their own). The backend
is :func:`qcomm.kernels.backend.backend_for`'s for the tensors' device: fused Triton kernels
on CUDA, the torch reference on CPU.
"""

from __future__ import annotations

import torch

from qcomm.kernels.accumulate_guard import AccumulateGuard
from qcomm.kernels.backend import backend_for
from qcomm.kernels.wire_format import QuantSpec

__all__ = ["dequant_accumulate_into", "dequantize_into", "quantize_into"]


def quantize_into(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor, seed: int,
                   error: torch.Tensor | None = None,
                   error_out: torch.Tensor | None = None) -> None:
    """``out <- Q(x + error)``, residual into ``error_out``: the kernel alone, no check at all.

    For callers that checked their arguments once for many calls (the gossip's rounds) and
    for :func:`quantize` after its checks. The caller guarantees what :func:`quantize`
    checks: ``spec`` valid; ``x`` float32/float16/bfloat16 ``[n]``, contiguous; ``out`` uint8
    ``[packed_nbytes(n, spec)]``, contiguous; ``error`` / ``error_out`` float32 ``[n]``,
    contiguous, not overlapping; all on one device; ``seed`` in [0, 2**64).

    Blocks of ``x + error`` holding NaN or Inf get a NaN scale in ``out`` and nothing is
    raised: the caller must look at the scales before using ``out`` (``error_out`` is then
    unspecified).
    """
    backend_for(x.device).quantize_into(x, spec, out, error, error_out, seed)


def dequant_accumulate_into(payloads: torch.Tensor, out: torch.Tensor, spec: QuantSpec,
                             weights: torch.Tensor | None = None,
                             guard: AccumulateGuard | None = None) -> None:
    """``out += sum_k weights[k] * D(payloads[k])``: the kernel alone, no check at all.

    The caller guarantees what :func:`dequant_accumulate` checks, and that the sum cannot
    overflow: ``payloads`` uint8 ``[K, packed_nbytes(n, spec)]``, contiguous, every scale
    finite and the bound of :mod:`qcomm.kernels.accumulate_guard` within float32's range;
    ``out`` float32 ``[n]``, contiguous; ``weights`` None or K finite floats, float32 ``[K]``
    on out's device. With a ``guard`` the backend checks the scales and the bound itself,
    writes nothing they fail and records its verdict in ``guard.verdict``.
    """
    backend_for(out.device).dequant_accumulate_into(payloads, spec, out, weights, guard)


def dequantize_into(payload: torch.Tensor, spec: QuantSpec, out: torch.Tensor) -> None:
    """``out <- D(payload)``: the kernel alone, no check at all. The caller guarantees what
    :func:`qcomm.compress.dequantize` checks: ``payload`` uint8 ``[packed_nbytes(n, spec)]``
    with finite scales, ``out`` float32/float16/bfloat16 ``[n]``, contiguous, on its device."""
    backend_for(out.device).dequantize_into(payload, spec, out)
