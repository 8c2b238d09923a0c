"""The codec's finiteness verdicts, computed on the device and read on the host once.

A verdict is one value ``[]``: a bool, or the largest magnitude among the checked values
(finite exactly when they all are). The blocking calls read it at once
(:func:`raise_if_nonfinite`); a ``non_blocking`` call hands it to a :class:`DeferredCheck`,
read when the caller asks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcomm.kernels.accumulate_guard import FLOAT32_MAX

from .errors import NonFiniteError, nonfinite_error

__all__ = ["DeferredCheck", "largest_magnitude", "nonfinite_in", "passes",
           "raise_if_nonfinite"]


def largest_magnitude(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """float32: the largest ``|value|`` of a non-empty float32 tensor (``[]``; along ``dim``
    when given), NaN or Inf where one of them is (one reduction on the device, nothing read)."""
    return torch.linalg.vector_norm(values, float("inf"), dim=dim)


def passes(verdict: torch.Tensor) -> bool:
    """A verdict read on the host: a bool's value, or whether a largest magnitude (float) is
    finite (NaN compares False)."""
    if verdict.dtype == torch.bool:
        return bool(verdict)
    return float(verdict) <= FLOAT32_MAX


def raise_if_nonfinite(scales: torch.Tensor, argument: str, what: str) -> None:
    """Raise NonFiniteError when any scale is NaN/Inf (one small read, one host sync)."""
    error = nonfinite_in(scales, argument, what)
    if error is not None:
        raise error


def nonfinite_in(scales: torch.Tensor, argument: str, what: str) -> NonFiniteError | None:
    """The NonFiniteError naming the scales' non-finite blocks, or None when all are finite
    (one small read, one host sync)."""
    if scales.numel() == 0 or passes(largest_magnitude(scales)):
        return None
    return nonfinite_error(scales, argument, what)


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
        if self._ok is not None and self._refused is not None and not passes(self._ok):
            raise self._refused()

    def ok(self) -> bool:
        """Whether the call passed its checks (reads the verdict as :meth:`wait`, no raise)."""
        try:
            self.wait()
        except (NonFiniteError, ValueError):
            return False
        return True
