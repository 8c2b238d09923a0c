"""The rule by which a dequantize-accumulate refuses a sum that might overflow float32.

``out += sum_k w_k D(payload_k)`` is bounded per element by ``sum_k |w_k| max|scale_k|`` times
the largest level of the width (:data:`MAX_ABS_LEVEL`). A backend given an
:class:`AccumulateGuard` computes that sum itself, in float64 with one rounding per operation,
k in order (``total = total + |w_k| * scale_max_k``), writes ``out`` only when::

    total * slack_factor(bits, K) <= float32's largest finite value

and writes that verdict into the guard's ``verdict``. The factor allows (K + 4) float32 ulps
of rounding in the kernel's products and sums; a NaN or Inf scale or weight fails it (NaN
compares False). Both backends compute the verdict with the same operations in the same order,
so they agree on it bit for bit; the Triton kernel states it again in its own arithmetic. Why
the check is made by the backend and not before the launch: a verdict read on the host before
the launch would cost a host sync on every call (docs/decisions.md, "Codec").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["FLOAT32_MAX", "MAX_ABS_LEVEL", "AccumulateGuard", "guard_total", "host_total",
           "slack_factor", "verdict_of"]

# |level| of the largest code of each width, valid or not (2**(bits-1) for 4 and 8 bits: the
# unused top code decodes to L + 1), so the bound holds for any payload.
MAX_ABS_LEVEL = {1: 1, 2: 1, 4: 8, 8: 128}
FLOAT32_MAX = torch.finfo(torch.float32).max
ULP_SLACK = 2.0**-24  # one float32 ulp, relative


class AccumulateGuard(NamedTuple):
    """What a guarded dequantize-accumulate is given.

    Attributes:
        scale_max: float32 ``[K]`` on out's device: the largest ``|scale|`` of each payload
            (NaN or Inf when one of its scales is).
        verdict: bool ``[]`` on out's device, written by the backend: True when it wrote the
            sum, False when the rule refused it (``out`` then unchanged).
    """

    scale_max: torch.Tensor
    verdict: torch.Tensor


def slack_factor(bits: int, k: int) -> float:
    """The largest level of ``bits`` times (1 + (k + 4) float32 ulps), exact in float64."""
    return MAX_ABS_LEVEL[bits] * (1.0 + (k + 4) * ULP_SLACK)


def guard_total(scale_max: list[float], weights: list[float] | None) -> float:
    """``sum_k |w_k| * scale_max_k`` in float64, k in order, one rounding per operation (the
    kernels' order); weights None counts as all ones."""
    total = 0.0
    for k, s in enumerate(scale_max):
        total = total + (s if weights is None else abs(weights[k]) * s)
    return total


def host_total(scale_max: torch.Tensor, weights: torch.Tensor | None) -> float:
    """:func:`guard_total` of the tensors (float32 ``[K]`` each, or weights None), read on the
    host."""
    return guard_total(scale_max.double().tolist(),
                       None if weights is None else weights.double().tolist())


def verdict_of(scale_max: torch.Tensor, weights: torch.Tensor | None, bits: int) -> bool:
    """The rule on the host (reads ``scale_max`` and ``weights``): whether the sum may be
    written."""
    return host_total(scale_max, weights) * slack_factor(bits, scale_max.numel()) <= FLOAT32_MAX
