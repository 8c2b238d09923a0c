"""qcomm's public codec: block quantization with fused error feedback, one uint8 wire format.

Quick use::

    from qcomm.compress import QuantSpec, quantize, dequantize, ErrorFeedback

    spec = QuantSpec(bits=4, block_size=128, rounding="stochastic")
    ef = ErrorFeedback()
    packed = ef.quantize("grads", grad, spec, seed=step)   # v = grad + e; e <- v - D(Q(v))
    send(packed.payload)                                   # uint8 [packed_nbytes(numel, spec)]
    dequant_accumulate(received, out, spec)                # out += sum_k D(received[k])

The byte layout, rounding rules and scales are in :mod:`qcomm.kernels.wire_format`, versioned by
:data:`WIRE_FORMAT_VERSION` (payloads carry no header: peers and saved payloads must agree on
it); stochastic rounding's random stream is in :mod:`qcomm.kernels.counter_hash`. CUDA tensors
run the fused Triton kernels (:mod:`qcomm.kernels.triton_codec`), CPU tensors the bit-identical
torch reference (:mod:`qcomm.kernels.reference`), chosen by :mod:`qcomm.kernels.backend`
(``QCOMM_BACKEND=reference|triton`` forces one; Triton is the optional ``gpu`` extra).

Non-finite input never leaks: a block holding NaN or Inf gets a NaN scale inside the kernel;
:func:`quantize` then raises :class:`NonFiniteError` and leaves the error buffer as it was;
:func:`dequant_accumulate` refuses non-finite scales and sums that would overflow float32
(:class:`AccumulateOverflowError`), leaving ``out`` untouched. The checks run on the device and
are read once per call, after the launch; with ``non_blocking=True`` they are not read at all
(no host sync) and :meth:`Packed.wait`, :meth:`ErrorFeedback.commit` or
:meth:`DeferredCheck.wait` raise later (why: docs/decisions.md, "Codec").
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from qcomm.kernels.accumulate_guard import (
    FLOAT32_MAX,
    MAX_ABS_LEVEL,
    AccumulateGuard,
    host_total,
)
from qcomm.kernels.backend import backend_for
from qcomm.kernels.wire_format import (
    INPUT_DTYPES,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    SUPPORTED_BITS,
    WIRE_FORMAT_VERSION,
    QuantSpec,
    check_spec,
    packed_nbytes,
    payload_scales,
)
from qcomm.seeds import draw_seed
from qcomm.validation import check_instance, check_seed, check_tensor

__all__ = [
    "WIRE_FORMAT_VERSION",
    "AccumulateOverflowError",
    "DeferredCheck",
    "ErrorFeedback",
    "NonFiniteError",
    "Packed",
    "QuantSpec",
    "dequant_accumulate",
    "dequantize",
    "packed_nbytes",
    "quantize",
]


class NonFiniteError(FloatingPointError):
    """Input to the codec holds NaN or Inf. Nothing was produced and no state was changed.

    Attributes:
        argument: the name of the offending argument (``"x"``, ``"packed"`` or ``"payloads"``).
        blocks: indices of the offending blocks (for ``"payloads"``: flat over ``[K, nblocks]``).
    """

    def __init__(self, message: str, argument: str, blocks: list[int]):
        super().__init__(message)
        self.argument = argument
        self.blocks = blocks


class AccumulateOverflowError(NonFiniteError, OverflowError):
    """:func:`dequant_accumulate` would have written Inf or NaN into ``out`` although every
    scale and weight is finite: the decoded payloads times the weights (plus ``out``) exceed
    float32's range. Nothing was written.

    Attributes:
        argument: ``"payloads"``.
        blocks: indices of the blocks of ``out`` (``block_size`` elements each) that would have
            become non-finite.
    """


class DeferredCheck:
    """The verdict of a codec call made with ``non_blocking=True``, read when asked for.

    Such a call computes its checks on the device (one value ``[]``), launches its work guarded
    by them (nothing that a failed check protects is written) and returns without reading
    them: no host sync. :meth:`wait` reads the verdict, one host read (a sync on an
    accelerator: place it where one happens anyway, e.g. after the step's collectives), and
    raises what the blocking call would have raised. The verdict is read on the current CUDA
    stream: wait on the stream that made the call, or after syncing it.
    """

    def __init__(self, ok: torch.Tensor | None = None,
                 refused: Callable[[], Exception] | None = None) -> None:
        # bool []: passes when True; float []: the largest magnitude among the checked values,
        # passes when finite (NaN and Inf fail). None: nothing to check (an empty call).
        self._ok = ok
        self._refused = refused

    def wait(self) -> None:
        """Read the verdict and raise if it failed: one host read each time. (The verdict is
        the call's own tensor: read again, it says the same, unless the call was captured in
        a CUDA graph, whose every replay writes it anew.)

        Raises:
            NonFiniteError, AccumulateOverflowError, ValueError: as the blocking call.
        """
        if self._ok is not None and self._refused is not None and not _passes(self._ok):
            raise self._refused()

    def ok(self) -> bool:
        """Whether the call passed its checks (reads the verdict as :meth:`wait`, no raise)."""
        try:
            self.wait()
        except (NonFiniteError, ValueError):
            return False
        return True


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
        _check_payload_tensor(self.payload, "payload", self.numel, self.spec, ndim=1)
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


# ---------------------------------------------------------------------------------------------
# argument checks: each names the argument and what is allowed


def _check_float_tensor(t: object, name: str, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    return check_tensor(name, t, dtypes=dtypes)


def _check_buffer(buf: object, name: str, like: torch.Tensor) -> torch.Tensor:
    """An fp32 buffer with ``like``'s numel and device, contiguous (written in place)."""
    buf = check_tensor(name, buf, dtypes=(torch.float32,))
    if buf.numel() != like.numel():
        raise ValueError(f"{name} must have numel {like.numel()} (like x), got {buf.numel()}")
    if buf.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like x), got {buf.device}")
    return check_tensor(name, buf, contiguous=True, why="it is updated in place")


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


def _check_payload_tensor(p: object, name: str, numel: int, spec: QuantSpec,
                          ndim: int) -> torch.Tensor:
    p = check_tensor(name, p, dtypes=(torch.uint8,))
    if p.dim() != ndim:
        shape = "[nbytes]" if ndim == 1 else "[K, nbytes]"
        raise ValueError(f"{name} must have shape {shape}, got {tuple(p.shape)}")
    if p.shape[-1] != packed_nbytes(numel, spec):
        raise ValueError(_length_mismatch(name, p.shape[-1], numel, spec))
    return check_tensor(name, p, contiguous=True)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _resolve_seed(seed: int | None, spec: QuantSpec) -> int:
    if seed is None:
        if spec.rounding == "nearest":
            return 0
        # Drawn from torch's default generator, so torch.manual_seed makes runs reproducible.
        return draw_seed()
    return check_seed(seed)


def _largest_magnitude(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """float32: the largest ``|value|`` of a non-empty float32 tensor (``[]``; along ``dim``
    when given), NaN or Inf where one of them is (one reduction on the device, nothing read)."""
    return torch.linalg.vector_norm(values, float("inf"), dim=dim)


def _passes(verdict: torch.Tensor) -> bool:
    """A verdict read on the host: a bool's value, or whether a largest magnitude (float) is
    finite (NaN compares False)."""
    if verdict.dtype == torch.bool:
        return bool(verdict)
    return float(verdict) <= FLOAT32_MAX


def _raise_if_nonfinite(scales: torch.Tensor, argument: str, what: str) -> None:
    """Raise NonFiniteError when any scale is NaN/Inf (one small read, one host sync)."""
    error = _nonfinite_in(scales, argument, what)
    if error is not None:
        raise error


def _nonfinite_in(scales: torch.Tensor, argument: str, what: str) -> NonFiniteError | None:
    """The NonFiniteError naming the scales' non-finite blocks, or None when all are finite
    (one small read, one host sync)."""
    if scales.numel() == 0 or _passes(_largest_magnitude(scales)):
        return None
    return _nonfinite_error(scales, argument, what)


def _nonfinite_error(scales: torch.Tensor, argument: str, what: str) -> NonFiniteError:
    """The NonFiniteError naming the blocks whose scale is NaN or Inf (host reads)."""
    blocks = (~torch.isfinite(scales)).flatten().nonzero().flatten().tolist()
    where = (f"in {len(blocks)} block(s), first block {blocks[0]}" if blocks else
             "(its blocks cannot be named: the payload was overwritten before the check was "
             "read)")
    return NonFiniteError(
        f"{argument} {what} non-finite values (NaN or Inf) {where}; nothing was produced and "
        f"no state was changed",
        argument,
        blocks,
    )


# ---------------------------------------------------------------------------------------------
# public functions


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
    x = _check_float_tensor(x, "x", INPUT_DTYPES)
    spec = check_spec(spec)
    if error is not None:
        error = _check_buffer(error, "error", x)
    if error_out is not None:
        error_out = _check_buffer(error_out, "error_out", x)
        if error is not None and _overlap(error, error_out):
            raise ValueError("error_out must not overlap error; pass only error for in place")
    out = _check_out(out, x, spec)
    check_instance("non_blocking", non_blocking, bool, what="True or False")
    return _quantize_checked(x, spec, error, error_out, _resolve_seed(seed, spec), out,
                             non_blocking)


def _check_out(out: torch.Tensor | None, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """:func:`quantize`'s ``out``, checked against ``x`` (a new payload when None)."""
    if out is None:
        return torch.empty(packed_nbytes(x.numel(), spec), dtype=torch.uint8, device=x.device)
    out = _check_payload_tensor(out, "out", x.numel(), spec, ndim=1)
    if out.device != x.device:
        raise ValueError(f"out must be on {x.device} (like x), got {out.device}")
    return out


def _quantize_checked(x: torch.Tensor, spec: QuantSpec, error: torch.Tensor | None,
                      error_out: torch.Tensor | None, seed: int, out: torch.Tensor,
                      non_blocking: bool = False) -> Packed:
    """:func:`quantize` once its arguments passed its checks (or the caller's equivalent ones):
    the kernel, the finiteness check (one host read, or none with ``non_blocking``), the
    residual."""
    n = x.numel()
    flat = x if x.dim() == 1 else x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    residual_out = error_out
    if error is not None and error_out is None:
        residual_out = torch.empty_like(error)  # scratch: error stays intact until we know
    _quantize_into(flat, spec, out, seed, _flat(error), _flat(residual_out))
    scales = payload_scales(out, n, spec)
    deferred = None
    if non_blocking:
        largest = _largest_magnitude(scales) if n else None
        deferred = DeferredCheck(largest, partial(_nonfinite_error, scales, "x",
                                                  "(plus error) has"))
        if largest is not None and error is not None and error_out is None:
            # the residual moves only if every scale is finite
            torch.where(largest <= FLOAT32_MAX, residual_out, error, out=error)
    else:
        _raise_if_nonfinite(scales, "x", "(plus error) has")
        if error is not None and error_out is None:
            error.copy_(residual_out)
    return Packed._unchecked(out, n, spec, x.shape, x.dtype, deferred)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous tensor as 1-D (itself when it is: a view costs the host a microsecond)."""
    return t if t is None or t.dim() == 1 else t.view(-1)


def _quantize_into(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor, seed: int,
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


def _dequant_accumulate_into(payloads: torch.Tensor, out: torch.Tensor, spec: QuantSpec,
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
    _raise_if_nonfinite(packed.scales, "packed", "carries")
    backend_for(device).dequantize_into(packed.payload, packed.spec, out.view(-1))
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
        weights: K finite floats (sequence or float32 tensor), or None for all ones. A
            sequence is checked on the host; a tensor's finiteness on the device, with the
            scales.
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
    payloads = _check_payloads(payloads, out, spec)
    k = payloads.shape[0]
    w = _weights_tensor(weights, k, out.device)
    non_blocking = check_instance("non_blocking", non_blocking, bool, what="True or False")
    if k == 0 or out.numel() == 0:
        return DeferredCheck() if non_blocking else out
    scales = payload_scales(payloads, out.numel(), spec)
    # One reduction before the launch; the backend weighs the maxima beside its sum and
    # writes the verdict (accumulate_guard's rule): nothing is read on the host first.
    guard = AccumulateGuard(_largest_magnitude(scales, dim=-1),
                            torch.empty((), dtype=torch.bool, device=out.device))
    _dequant_accumulate_into(payloads, _flat(out), spec, w, guard)
    if non_blocking:
        return DeferredCheck(guard.verdict, partial(_accumulate_refused, scales, w, guard, spec))
    if bool(guard.verdict):  # the one host read, after the launch: the kernel did not wait
        return out
    refused = _accumulate_refused(scales, w, guard, spec, overflow=False)
    if refused is not None:
        raise refused
    return _accumulate_aside(payloads, out, spec, w, _accumulate_bound(guard, w, spec))


def _check_payloads(payloads: object, out: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """:func:`dequant_accumulate`'s ``payloads`` as uint8 ``[K, nbytes]`` on out's device."""
    if isinstance(payloads, torch.Tensor) and payloads.dim() == 1:
        payloads = payloads.unsqueeze(0)
    payloads = _check_payload_tensor(payloads, "payloads", out.numel(), spec, ndim=2)
    if payloads.device != out.device:
        raise ValueError(f"payloads must be on {out.device} (like out), got {payloads.device}")
    return payloads


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
    error = _nonfinite_in(scales, "payloads", "carry")
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
    _dequant_accumulate_into(payloads, trial, spec, w)
    bad = ~torch.isfinite(trial)
    if bool(bad.any()):
        blocks = torch.unique(bad.nonzero().flatten() // spec.block_size).tolist()
        raise AccumulateOverflowError(
            f"payloads times weights would overflow float32 in out: {len(blocks)} block(s), "
            f"first block {blocks[0]} (the decoded sum can reach {bound:.3g}, float32 holds "
            f"{FLOAT32_MAX:.3g}); nothing was written", "payloads", blocks)
    out.view(-1).copy_(trial)
    return out


class ErrorFeedback:
    """Error-feedback residuals, one per key (a parameter name, a bucket index, a shard).

    Buffers are created lazily on first use with the tensor's numel and device. Each key holds a
    current residual and a spare of the same size: :meth:`quantize` reads the current one and
    writes the new residual into the spare (one pass over memory, no scratch copy), then swaps
    them, so a :class:`NonFiniteError` leaves the residual exactly as it was.
    """

    def __init__(self) -> None:
        self._residuals: dict[str | int, torch.Tensor] = {}
        self._spares: dict[str | int, torch.Tensor] = {}
        self._pending: set[str | int] = set()  # keys whose new residual awaits commit()
        self._deferred: dict[str | int, Packed] = {}  # pending keys of non_blocking calls

    def __contains__(self, key: str | int) -> bool:
        return key in self._residuals

    def keys(self) -> list[str | int]:
        return list(self._residuals)

    def residual(self, key: str | int) -> torch.Tensor | None:
        """The current float32 residual for ``key`` (flat), or None before first use."""
        return self._residuals.get(key)

    def quantize(self, key: str | int, x: torch.Tensor, spec: QuantSpec, *,
                 seed: int | None = None, out: torch.Tensor | None = None,
                 commit: bool = True, non_blocking: bool = False) -> Packed:
        """Quantize ``x`` with the residual stored under ``key`` and update it.

        Same arguments and errors as :func:`quantize`. Raises ValueError if ``key`` already
        holds a residual of another numel or device.

        ``commit=False`` computes the new residual but keeps the current one until
        :meth:`commit` (a collective that may still fail after this message was sent then
        changes no residual if it fails: the caller commits only once every stage succeeded);
        the next ``quantize`` of ``key`` drops an uncommitted residual.

        ``non_blocking=True`` (with ``commit=False``: a residual cannot move before its check
        is read) leaves the finiteness check on the device, no host sync here: :meth:`commit`
        reads it and raises the :class:`NonFiniteError` that the blocking call would have
        (the residual then stays as it was); :meth:`Packed.wait` reads it too.
        """
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"key must be a str or int, got {key!r}")
        check_instance("non_blocking", non_blocking, bool, what="True or False")
        if non_blocking and check_instance("commit", commit, bool, what="True or False"):
            raise ValueError("non_blocking=True needs commit=False: the residual moves at "
                             "commit(key), which reads the deferred check first")
        x = _check_float_tensor(x, "x", INPUT_DTYPES)
        res = self._residuals.get(key)
        if res is None:
            res = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        elif res.numel() != x.numel() or res.device != x.device:
            raise ValueError(
                f"key {key!r} holds a residual of {res.numel()} elements on {res.device}; "
                f"x has {x.numel()} on {x.device} (use another key or reset({key!r}))"
            )
        spare = self._spares.get(key)
        if spare is None:
            spare = torch.empty_like(res)
        # The residual and the spare are this object's own (float32, x's numel and device,
        # contiguous, apart): quantize's checks of x, error and error_out would re-prove them.
        spec = check_spec(spec)
        out = _check_out(out, x, spec)
        packed = _quantize_checked(x, spec, res, spare, _resolve_seed(seed, spec), out,
                                   non_blocking)
        self._deferred.pop(key, None)
        if commit:
            self._residuals[key], self._spares[key] = spare, res
            self._pending.discard(key)
        else:  # the new residual waits in the spare
            self._residuals[key], self._spares[key] = res, spare
            self._pending.add(key)
            if non_blocking:
                self._deferred[key] = packed
        return packed

    def commit(self, key: str | int) -> None:
        """Make the residual computed by ``quantize(key, ..., commit=False)`` the current one
        (nothing when none is pending).

        Raises:
            NonFiniteError: the pending residual came from a ``non_blocking`` call whose input
                held NaN or Inf (read here, one host read); it is dropped, the residual stays.
        """
        if key in self._pending:
            deferred = self._deferred.pop(key, None)
            self._pending.discard(key)
            if deferred is not None:
                deferred.wait()
            self._residuals[key], self._spares[key] = self._spares[key], self._residuals[key]

    def reset(self, key: str | int | None = None) -> None:
        """Forget the residual of ``key`` (all keys when None)."""
        if key is None:
            self._residuals.clear()
            self._spares.clear()
            self._pending.clear()
            self._deferred.clear()
        else:
            self._residuals.pop(key, None)
            self._spares.pop(key, None)
            self._pending.discard(key)
            self._deferred.pop(key, None)

    def state_dict(self) -> dict[str, dict[str | int, torch.Tensor]]:
        """``{"residuals": {key: float32 tensor}}`` (references, like torch's state_dicts)."""
        return {"residuals": dict(self._residuals)}

    def load_state_dict(self, state: dict) -> None:
        """Load residuals saved by :meth:`state_dict` (copied; devices kept as saved)."""
        if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
            raise ValueError("state must be a dict {'residuals': {key: tensor}} from state_dict()")
        loaded: dict[str | int, torch.Tensor] = {}
        for key, t in state["residuals"].items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                raise ValueError(f"residual {key!r} must be a 1-D float32 tensor")
            loaded[key] = t.detach().clone()
        self._residuals = loaded
        self._spares = {}
        self._pending = set()
        self._deferred = {}
