"""The interface a codec backend implements, and the two qcomm ships.

:mod:`qcomm.compress` checks every argument, then calls one of these three operations on the
backend chosen for the tensors' device type. A backend computes exactly the arithmetic of
:mod:`qcomm.kernels.wire_format`: the same payload bytes and the same residual bits from the
same input and seed, whichever backend runs (``tests/kernels/test_triton_parity.py``).

* :class:`ReferenceBackend`: pure torch (:mod:`qcomm.kernels.reference`), any device; the CPU
  path and the oracle.
* :class:`TritonBackend`: fused Triton kernels (:mod:`qcomm.kernels.triton_codec`), CUDA (or CPU
  tensors under ``TRITON_INTERPRET=1``). Triton is an optional dependency (the ``gpu`` extra):
  constructing this backend without it raises an ImportError that says so.

:func:`backend_for` chooses one per device type, once (``QCOMM_BACKEND`` forces one);
:func:`backend_name` says which; :func:`reset_backends` forgets the choices.

Arguments arrive validated and flat: ``x``/``out`` 1-D and contiguous, ``payload`` uint8
``[packed_nbytes(n, spec)]`` (``payloads`` ``[K, packed_nbytes(n, spec)]``), everything on one
device, the seed an int in [0, 2**64). Backends do not check them again.
"""

from __future__ import annotations

import importlib
import os
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from qcomm.kernels.accumulate_guard import AccumulateGuard
from qcomm.kernels.wire_format import QuantSpec
from qcomm.validation import check_choice

__all__ = ["BACKENDS", "GPU_EXTRA_HINT", "CodecBackend", "ReferenceBackend", "TritonBackend",
           "backend_for", "backend_name", "reset_backends"]

BACKENDS = ("reference", "triton")

GPU_EXTRA_HINT = "pip install -e '.[gpu]' in a qcomm checkout (or pip install triton)"


class CodecBackend(ABC):
    """One implementation of the codec's three operations (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def quantize_into(self, x: torch.Tensor, spec: QuantSpec, payload: torch.Tensor,
                      error_in: torch.Tensor | None, error_out: torch.Tensor | None,
                      seed: int) -> None:
        """Quantize ``x`` (+ ``error_in``) into ``payload``; write the new residual to
        ``error_out``.

        Args:
            x: float32/float16/bfloat16 ``[n]``.
            payload: uint8 ``[packed_nbytes(n, spec)]``, written whole.
            error_in: float32 ``[n]`` added before quantizing, or None.
            error_out: float32 ``[n]`` receiving ``v - D(payload)``, or None; may alias
                ``error_in``.
            seed: stochastic-rounding seed (ignored for nearest rounding).
        """

    @abstractmethod
    def dequantize_into(self, payload: torch.Tensor, spec: QuantSpec,
                        out: torch.Tensor) -> None:
        """Decode uint8 ``payload`` ``[packed_nbytes(n, spec)]`` into ``out`` (float ``[n]``)."""

    @abstractmethod
    def dequant_accumulate_into(self, payloads: torch.Tensor, spec: QuantSpec,
                                out: torch.Tensor, weights: torch.Tensor | None,
                                guard: AccumulateGuard | None = None) -> None:
        """``out += sum_k weights[k] * D(payloads[k])``, k in order, one rounding per operation.

        Args:
            payloads: uint8 ``[K, packed_nbytes(n, spec)]``.
            out: float32 ``[n]``, updated in place.
            weights: float32 ``[K]`` on out's device, or None (all ones, no multiply).
            guard: None, or the payloads' largest scales and a verdict to write: the backend
                decides by :mod:`qcomm.kernels.accumulate_guard`'s rule whether the sum may be
                written, writes it only then, and records the verdict on the device, so that
                the call needs no host sync before its launch.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _ModuleBackend(CodecBackend):
    """A backend whose operations are the functions of one module of this package."""

    def __init__(self, module: object) -> None:
        self._impl = module

    def quantize_into(self, x, spec, payload, error_in, error_out, seed):
        self._impl.quantize_into(x, spec, payload, error_in, error_out, seed)

    def dequantize_into(self, payload, spec, out):
        self._impl.dequantize_into(payload, spec, out)

    def dequant_accumulate_into(self, payloads, spec, out, weights, guard=None):
        self._impl.dequant_accumulate_into(payloads, spec, out, weights, guard)


class ReferenceBackend(_ModuleBackend):
    """The pure-torch reference: vectorized eager torch, any device."""

    name = "reference"

    def __init__(self) -> None:
        from qcomm.kernels import reference

        super().__init__(reference)


class TritonBackend(_ModuleBackend):
    """The fused Triton kernels: one pass over memory per operation.

    Raises:
        ImportError: Triton is not installed (it comes with the ``gpu`` extra).
    """

    name = "triton"

    def __init__(self) -> None:
        try:
            # import_module, not "from qcomm.kernels import ...": that would accept a module
            # object left on the package by an earlier import even when triton is gone now.
            triton_codec = importlib.import_module("qcomm.kernels.triton_codec")
        except ImportError as e:
            raise ImportError(f"qcomm's Triton backend needs triton, which is not installed: "
                              f"{GPU_EXTRA_HINT}") from e
        super().__init__(triton_codec)


# The backend of each device type, chosen on the first codec call on that type (the
# environment is read then, once) and kept: a codec call costs a dict lookup, not an
# environment read and an import attempt.
_backends: dict[str, CodecBackend] = {}
_warned_no_triton = False


def backend_for(device: torch.device) -> CodecBackend:
    """The backend that runs codec calls on ``device``'s type (chosen once, then cached).

    ``QCOMM_BACKEND`` (read at the first call per device type): unset or ``auto`` picks the
    Triton kernels for CUDA tensors when triton is installed, else the reference (CUDA tensors
    without triton run the reference on the GPU, with a warning naming the ``gpu`` extra: same
    bytes, slower); ``reference`` forces the reference; ``triton`` forces the kernels (CPU
    tensors then need ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: ``QCOMM_BACKEND`` is none of the above, or ``triton`` on a CPU tensor
            without the interpreter.
        ImportError: ``QCOMM_BACKEND=triton`` without triton installed.
    """
    backend = _backends.get(device.type)
    if backend is None:
        backend = _backends[device.type] = _choose_backend(device.type)
    return backend


def _choose_backend(device_type: str) -> CodecBackend:
    global _warned_no_triton
    forced = check_choice("QCOMM_BACKEND",
                          os.environ.get("QCOMM_BACKEND", "").strip().lower() or "auto",
                          ("auto", *BACKENDS))
    if forced == "reference":
        return ReferenceBackend()
    if forced == "triton":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "QCOMM_BACKEND=triton on a CPU tensor needs TRITON_INTERPRET=1 "
                "(Triton compiles for CUDA devices only)"
            )
        return TritonBackend()
    if device_type != "cuda":
        return ReferenceBackend()
    try:
        return TritonBackend()
    except ImportError:
        if not _warned_no_triton:
            _warned_no_triton = True
            warnings.warn(f"qcomm: triton is not installed, so CUDA tensors run the pure-torch "
                          f"codec (the same bytes, slower); for the fused kernels: "
                          f"{GPU_EXTRA_HINT}", RuntimeWarning, stacklevel=4)
        return ReferenceBackend()


def reset_backends() -> None:
    """Forget the backends chosen so far: the next codec call reads ``QCOMM_BACKEND`` again
    (for programs and tests that change it at run time)."""
    _backends.clear()


def backend_name(device: torch.device) -> str:
    """The backend that runs codec calls on ``device``: ``"triton"`` or ``"reference"``."""
    return backend_for(device).name
