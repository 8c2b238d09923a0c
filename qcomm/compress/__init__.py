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
:meth:`DeferredCheck.wait` raise later (why: docs/decisions.md, "Codec"). Modules: encode,
decode, error_feedback, packed, errors, verdict (the checks' verdicts), arguments (the argument
checks), unchecked (the kernels without checks, for callers that checked once).
"""

from qcomm.kernels.wire_format import WIRE_FORMAT_VERSION, QuantSpec, packed_nbytes

from .decode import dequant_accumulate, dequantize
from .encode import quantize
from .error_feedback import ErrorFeedback
from .errors import AccumulateOverflowError, NonFiniteError
from .packed import Packed
from .verdict import DeferredCheck

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
