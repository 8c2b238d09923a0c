"""Decoding: one message into a tensor (:func:`dequantize`), or K peers' messages summed into
one (:func:`dequant_accumulate`), with the guard that refuses a sum that would overflow."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from functools import partial

import torch

from qcomm.kernels.accumulate_guard import (
    FLOAT32_MAX,
    MAX_ABS_LEVEL,
    AccumulateGuard,
    host_total,
)
from qcomm.kernels.wire_format import INPUT_DTYPES, QuantSpec, check_spec, payload_scales
from qcomm.validation import check_instance, check_tensor

from .arguments import check_payloads, flat
from .errors import AccumulateOverflowError
from .packed import Packed
from .unchecked import dequant_accumulate_into, dequantize_into
from .verdict import DeferredCheck, largest_magnitude, nonfinite_in, raise_if_nonfinite

__all__ = ["dequant_accumulate", "dequantize"]


def dequantize(packed: Packed, *, out: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode a Packed message.

    Args:
        packed: a Packed (see :meth:`Packed.from_payload` for received bytes).
        out: float32/float16/bfloat16 with ``packed.numel`` elements on the payload's device,
            contiguous; written in place and returned.
        dtype: output dtype when ``out`` is None; default ``packed.dtype``.

    Returns:
        Tensor of shape ``packed.shape`` (or ``out``'s shape) with the decoded values.

    Raises:
        NonFiniteError: the payload carries a non-finite scale; ``out`` is unchanged.
    """
    check_instance("packed", packed, Packed, what="a qcomm.compress.Packed")
    device = packed.payload.device
    if out is None:
        dtype = packed.dtype if dtype is None else dtype
        if dtype not in INPUT_DTYPES:
            raise TypeError(f"dtype must be one of {INPUT_DTYPES}, got {dtype}")
        out = torch.empty(packed.shape, dtype=dtype, device=device)
    else:
        check_tensor("out", out, dtypes=INPUT_DTYPES, numel=packed.numel, device=device,
                     contiguous=True, why="it is written in place")
    raise_if_nonfinite(packed.scales, "packed", "carries")
    dequantize_into(packed.payload, packed.spec, out.view(-1))
    return out


def dequant_accumulate(payloads: torch.Tensor, out: torch.Tensor, spec: QuantSpec,
                       weights: Sequence[float] | torch.Tensor | None = None, *,
                       non_blocking: bool = False) -> torch.Tensor | DeferredCheck:
    """``out += sum_k weights[k] * D(payloads[k])`` in one pass, without decoding each payload
    into its own tensor.

    Args:
        payloads: uint8 ``[K, packed_nbytes(out.numel(), spec)]`` (or ``[nbytes]`` for K = 1),
            on out's device: K peers' messages.
        out: float32, any shape, contiguous; updated in place and returned.
        spec: the QuantSpec the payloads were made with.
        weights: K finite floats (a sequence, or a tensor of K real values, taken as
            float32 on out's device), or None for all ones. A sequence is checked on the
            host; a tensor's finiteness on the device, with the scales.
        non_blocking: False (default): the checks below are read once, after the launch (one
            host sync on an accelerator), and raise here. True: the call returns a
            :class:`DeferredCheck` without a sync; its ``wait()`` raises the same errors, but
            for a sum that only might overflow (see below), which it refuses unwritten
            (AccumulateOverflowError) instead of computing it aside.

    Returns:
        ``out`` (or, with ``non_blocking``, the :class:`DeferredCheck`).

    Raises:
        NonFiniteError: a payload carries a non-finite scale; ``out`` is unchanged.
        AccumulateOverflowError: finite scales and weights whose sum would overflow float32
            (Inf or NaN in ``out``); ``out`` is unchanged. Checked cheaply: the scales and
            weights bound ``|sum_k weights[k] * D(payloads[k])|`` per element (largest level
            times largest scale, per payload); the kernel computes that bound beside its sum
            and writes only when it is within float32's range. Only when it is not is the sum
            computed into a copy of ``out`` and checked before ``out`` is written, so a sum
            that could overflow but does not is no error. ``out``'s own magnitude is not in
            the bound: an ``out`` already within one decoded term of the float32 limit can
            still overflow.
        ValueError: weights not finite (a tensor's found with the scales; ``out`` unchanged).
    """
    spec = check_spec(spec)
    out = check_tensor("out", out, dtypes=(torch.float32,), contiguous=True,
                       why="it is updated in place")
    payloads = check_payloads(payloads, out, spec)
    k = payloads.shape[0]
    w = _weights_tensor(weights, k, out.device)
    non_blocking = check_instance("non_blocking", non_blocking, bool, what="True or False")
    if k == 0 or out.numel() == 0:
        return DeferredCheck() if non_blocking else out
    scales = payload_scales(payloads, out.numel(), spec)
    # One reduction before the launch; the backend weighs the maxima beside its sum and
    # writes the verdict (accumulate_guard's rule): nothing is read on the host first.
    guard = AccumulateGuard(largest_magnitude(scales, dim=-1),
                            torch.empty((), dtype=torch.bool, device=out.device))
    dequant_accumulate_into(payloads, flat(out), spec, w, guard)
    if non_blocking:
        return DeferredCheck(guard.verdict, partial(_accumulate_refused, scales, w, guard, spec))
    if bool(guard.verdict):  # the one host read, after the launch: the kernel did not wait
        return out
    refused = _accumulate_refused(scales, w, guard, spec, overflow=False)
    if refused is not None:
        raise refused
    return _accumulate_aside(payloads, out, spec, w, _accumulate_bound(guard, w, spec))


# Weights given as a sequence, as tensors on their device: the same mixing weights come every
# round, and a fresh host-to-device copy per call would cost a sync of its own.
_WEIGHTS_CACHE: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}
_WEIGHTS_CACHE_SIZE = 64


def _weights_tensor(weights: Sequence[float] | torch.Tensor | None, k: int,
                    device: torch.device) -> torch.Tensor | None:
    """The weights as float32 ``[k]`` on ``device`` (None for None). A sequence must hold
    ``k`` finite reals (checked here, on the host); a tensor's finiteness is checked on the
    device with the scales."""
    if weights is None:
        return None
    if type(weights) in (list, tuple) and len(weights) == k and 0.0 not in weights and all(
            type(v) is float for v in weights):  # the usual call: checked when cached
        w = _WEIGHTS_CACHE.get((tuple(weights), device))
        if w is not None:
            return w
    if not isinstance(weights, (torch.Tensor, Sequence)):  # a numpy array, say
        weights = torch.as_tensor(weights, dtype=torch.float32)
    if isinstance(weights, torch.Tensor):
        if weights.dtype == torch.bool or weights.is_complex():
            raise TypeError(f"weights must be a sequence of K = {k} real numbers or a tensor "
                            f"of K real values, got a tensor of dtype {weights.dtype}")
        w = weights.to(device=device, dtype=torch.float32).reshape(-1)
        if w.numel() != k:
            raise ValueError(f"weights must have K = {k} entries (one per payload), "
                             f"got {w.numel()}")
        return w
    if isinstance(weights, (str, bytes)) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in weights):
        raise TypeError(f"weights must be a sequence of K = {k} real numbers or a float32 "
                        f"tensor, got {weights!r}")
    if len(weights) != k:
        raise ValueError(f"weights must have K = {k} entries (one per payload), "
                         f"got {len(weights)}")
    values = tuple(float(v) for v in weights)
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"weights must be finite, got {list(values)}")
    if 0.0 in values:  # -0.0 == 0.0 as a key: the zero's sign would be another call's
        return torch.tensor(values, dtype=torch.float32).to(device)
    w = _WEIGHTS_CACHE.get((values, device))
    if w is None:
        if len(_WEIGHTS_CACHE) >= _WEIGHTS_CACHE_SIZE:
            _WEIGHTS_CACHE.clear()
        # Made on the host and copied over whole (a blocking copy from pageable memory):
        # nothing of it is left pending on one stream for a call on another.
        w = _WEIGHTS_CACHE[(values, device)] = torch.tensor(values, dtype=torch.float32).to(device)
    return w


def _accumulate_bound(guard: AccumulateGuard, weights: torch.Tensor | None,
                      spec: QuantSpec) -> float:
    """The largest magnitude the decoded sum can reach (host reads: on failure only)."""
    return host_total(guard.scale_max, weights) * MAX_ABS_LEVEL[spec.bits]


def _accumulate_refused(scales: torch.Tensor, weights: torch.Tensor | None,
                        guard: AccumulateGuard, spec: QuantSpec,
                        overflow: bool = True) -> Exception | None:
    """Why :func:`dequant_accumulate`'s guard failed (host reads: on failure only): weights
    not finite, a scale not finite, or (``overflow``) a bound past float32's range; None
    when only the last holds and ``overflow`` is False (the caller then sums aside)."""
    if weights is not None and not bool(torch.isfinite(weights).all()):
        return ValueError(f"weights must be finite, got {weights.tolist()}")
    error = nonfinite_in(scales, "payloads", "carry")
    if error is not None or not overflow:
        return error
    return AccumulateOverflowError(
        f"payloads times weights might overflow float32 in out (the decoded sum can reach "
        f"{_accumulate_bound(guard, weights, spec):.3g}, float32 holds {FLOAT32_MAX:.3g}); "
        f"nothing was written. The blocking call (non_blocking=False) computes such a sum "
        f"aside and writes it when it does not overflow", "payloads", [])


def _accumulate_aside(payloads: torch.Tensor, out: torch.Tensor, spec: QuantSpec,
                      w: torch.Tensor | None, bound: float) -> torch.Tensor:
    """The sum of :func:`dequant_accumulate` whose bound passes float32's range, computed into
    a copy of ``out`` and written only if finite (AccumulateOverflowError otherwise)."""
    trial = out.reshape(-1).clone()
    dequant_accumulate_into(payloads, trial, spec, w)
    bad = ~torch.isfinite(trial)
    if bool(bad.any()):
        blocks = torch.unique(bad.nonzero().flatten() // spec.block_size).tolist()
        raise AccumulateOverflowError(
            f"payloads times weights would overflow float32 in out: {len(blocks)} block(s), "
            f"first block {blocks[0]} (the decoded sum can reach {bound:.3g}, float32 holds "
            f"{FLOAT32_MAX:.3g}); nothing was written", "payloads", blocks)
    out.view(-1).copy_(trial)
    return out
