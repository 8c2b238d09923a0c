"""Property checks for block-quantization codecs: qcomm's, or your own.

A codec is given as plain callables, so any implementation can be checked::

    quantize(v, seed) -> payload          v: float32 [n]; payload: anything
    dequantize(payload) -> float32 [n]
    step(payload) -> float32 [n]          the quantization step (scale) Delta of each element
    quantize_ef(x, error, seed) -> (payload, new_error)       error feedback, float32 [n]
    pack(codes, scales) -> uint8 [nbytes];  unpack(payload, numel) -> (codes, scales)

:class:`QcommCodec` provides all of them for a :class:`~qcomm.kernels.wire_format.QuantSpec`.
Every check returns None or raises AssertionError naming the element, the values and the bound.

Tolerances. All bounds are stated for a codec computing in float32 with round-to-nearest:
``u = 2**-24`` is its unit roundoff, so one rounded operation ``fl(y)`` satisfies
``|fl(y) - y| <= u * |fl(y)|`` when the result is normal and ``|fl(y) - y| <= 2**-150`` when it
is subnormal. Pass ``eps`` for a codec that computes in another precision. The checks compute
their own sums in float64 (53 bits), whose error is bounded explicitly where it matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qcomm.kernels import reference
from qcomm.kernels.wire_format import QuantSpec, codes_nbytes, packed_nbytes, split_payload
from qcomm.validation import check_instance, check_real

__all__ = [
    "FP32_EPS",
    "FP32_SUBNORMAL_ABS",
    "QcommCodec",
    "check_error_bound",
    "check_error_feedback_conservation",
    "check_roundtrip",
    "check_unbiased",
]

FP32_EPS = 2.0**-24
"""Unit roundoff of float32 round-to-nearest: ``|fl(y) - y| <= FP32_EPS * |fl(y)|``."""
FP32_SUBNORMAL_ABS = 2.0**-149
"""Absolute slack for one rounding into float32's subnormal range (at most half of this)."""
_F64_EPS = 2.0**-53

Payload = Any


def _flat64(t: torch.Tensor, name: str, numel: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AssertionError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    t = t.detach().reshape(-1).to("cpu", torch.float64)
    if numel is not None and t.numel() != numel:
        raise AssertionError(f"{name} has {t.numel()} elements, expected {numel}")
    return t


def _fail_first(bad: torch.Tensor, what: str, **cols: torch.Tensor) -> None:
    """Raise AssertionError for the first True of ``bad`` [n], listing ``cols`` there."""
    if not bool(bad.any()):
        return
    idx = bad.nonzero().flatten()
    i = int(idx[0])
    detail = ", ".join(f"{k}={float(v[i])!r}" for k, v in cols.items())
    raise AssertionError(f"{what}: {idx.numel()} element(s) violate it; first element {i}: "
                         f"{detail}")


# ---------------------------------------------------------------------------------------------
# deterministic rounding


def _slack(eps: object, level_slack: object) -> tuple[float, float]:
    """The checks' slack arguments, each a finite float >= 0 (a negative one would fail a
    correct codec, and the failure would read as the codec's)."""
    return check_real("eps", eps, low=0), check_real("level_slack", level_slack, low=0)


def check_error_bound(
    quantize: Callable[[torch.Tensor, int], Payload],
    dequantize: Callable[[Payload], torch.Tensor],
    v: torch.Tensor,
    *,
    step: Callable[[Payload], torch.Tensor],
    seed: int = 0,
    eps: float = FP32_EPS,
    level_slack: float = 0.0,
) -> None:
    """Round to nearest: ``|D(Q(v)) - v| <= Delta / 2`` per element, up to float rounding.

    Args:
        quantize, dequantize, step: the codec (see the module docstring); ``step`` gives each
            element's quantization step Delta (the spacing of the levels around it; the block
            scale for a code of integer multiples of the scale) as the decoder uses it.
        v: float32/float16/bfloat16 ``[n]`` (any shape, flattened), finite.
        seed: passed to ``quantize``.
        eps: unit roundoff of the codec's arithmetic.
        level_slack: extra slack ``level_slack * eps * Delta`` for a codec whose way to the
            level rounds more often than the one below (qcomm's 2-bit code: 6, derived in
            :mod:`qcomm.kernels.wire_format`; :attr:`QcommCodec.level_slack` has it).

    Bound and its slack. A codec of this kind computes ``t = fl(v / Delta)``, ``q = rint(t)``,
    ``d = fl(q * Delta)``. Then ``|q - t| <= 1/2`` and ``|t - v/Delta| <= eps |v / Delta|`` (if
    ``t`` is subnormal, ``q = 0`` and ``|d - v| = |v| < Delta/2`` anyway), so
    ``|q Delta - v| <= Delta/2 + eps |v|``; and ``|d - q Delta| <= eps |d| + 2**-150``. Hence::

        |d - v| <= Delta/2 + eps * (|v| + |d|) + 2**-149

    The slack is a couple of ulps of the values involved; a codec that rounds wrongly by even
    one level (floor instead of round, a scale off by one level) errs by up to Delta.
    """
    eps, level_slack = _slack(eps, level_slack)
    v = v.reshape(-1)
    payload = quantize(v.to(torch.float32), seed)
    n = v.numel()
    d = _flat64(dequantize(payload), "dequantize(payload)", n)
    delta = _flat64(step(payload), "step(payload)", n)
    v64 = _flat64(v, "v")
    if not bool(torch.isfinite(v64).all()):
        raise AssertionError("v must be finite for check_error_bound")
    err = (d - v64).abs()  # exact enough: float64 difference of two float32 values
    bound = (delta / 2 + eps * (v64.abs() + d.abs()) + level_slack * eps * delta
             + FP32_SUBNORMAL_ABS)
    _fail_first(~(err <= bound),
                "|D(Q(v)) - v| <= step/2 + eps*(|v|+|d|) + level_slack*eps*step + 2**-149",
                v=v64, decoded=d, step=delta, error=err, bound=bound)


# ---------------------------------------------------------------------------------------------
# stochastic rounding


def check_unbiased(
    quantize: Callable[[torch.Tensor, int], Payload],
    dequantize: Callable[[Payload], torch.Tensor],
    v: torch.Tensor,
    *,
    step: Callable[[Payload], torch.Tensor],
    num_seeds: int = 1000,
    first_seed: int = 0,
    alpha: float = 1e-6,
    check_variance: bool = True,
    eps: float = FP32_EPS,
    level_slack: float = 0.0,
) -> None:
    """Stochastic rounding: ``E[D(Q(v))] = v`` per element, and (QSGD, Alistarh et al. 2017,
    Lemma 3.1, per coordinate) ``E[(D(Q(v)) - v)**2] <= Delta**2 / 4``.

    Quantizes ``v`` with seeds ``first_seed .. first_seed + num_seeds - 1`` (the seeds are taken
    to give independent draws) and raises if the samples are implausible for an unbiased codec.
    Its false-failure probability on a correct codec is at most ``alpha``.

    Args:
        quantize, dequantize, step: the codec; ``step(payload)`` (Delta per element) must not
            depend on the seed.
        v: float ``[n]`` (any shape, flattened), finite.
        num_seeds: N, the samples per element.
        alpha: false-failure probability of the whole check, split evenly over its tests.
        check_variance: also test the per-coordinate second moment against Delta**2 / 4.
        eps: unit roundoff of the codec's arithmetic.
        level_slack: as in :func:`check_error_bound`; widens the support slack ``s`` and the
            bias allowance ``b`` below by ``level_slack * eps * Delta`` each.

    The math. Per element, a correct codec decodes to one of the two levels around ``v``,
    ``floor(v/Delta) Delta`` or the next one, with probability making the mean ``v``. So every
    sample ``d`` lies in an interval of width ``R = Delta + 2 s`` around ``v``, where
    ``s = eps (|v| + |d|) + 2**-149`` is the float slack of :func:`check_error_bound` (it is
    checked deterministically: support test). Float rounding also biases the mean by at most
    ``b = Delta (2**-24 + eps) + eps (2|v| + Delta)``: uniforms quantized to 2**-24, the
    rounding of ``v/Delta`` and of ``q * Delta``.

    1. Per-element mean (a z-test). ``z_i = (mean_i - v_i - b_i) / (R_i / (2 sqrt N))``
       standardizes the sample mean by the largest standard deviation a variable on an
       interval of width R can have (R/2). Hoeffding's inequality gives the tail without a
       normal approximation, valid at every N: ``P(|z| >= c) <= 2 exp(-c**2 / 2)``. With
       ``m`` elements of nonzero Delta and Bonferroni over them, ``c = sqrt(2 ln(2 m / a1))``
       with ``a1 = alpha / 3``: any single element fails with probability <= a1 / m.
    2. Pooled mean. A systematic bias too small to see per element shows in the mean of
       ``(d - v) / R`` over all ``N m`` samples (independent, each in an interval of width 1):
       ``P(|pooled - E| >= t) <= 2 exp(-2 N m t**2)``, ``t = sqrt(ln(2 / a2) / (2 N m))``.
    3. Second moment (if ``check_variance``). ``(d - v)**2`` lies in ``[0, R**2]``, its mean is
       ``p (1 - p) Delta**2 + bias**2 <= R**2 / 4``; one-sided Hoeffding with Bonferroni:
       ``mse_i <= R**2 / 4 + R**2 sqrt(ln(m / a3) / (2 N))``.

    With ``a1 = a2 = a3 = alpha / 3`` the union bound gives a false failure with probability
    <= alpha. Elements with ``Delta = 0`` must decode exactly to ``v`` (checked, not tested).
    """
    if num_seeds < 2:
        raise ValueError(f"num_seeds must be >= 2, got {num_seeds}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    eps, level_slack = _slack(eps, level_slack)
    v32 = v.reshape(-1).to(torch.float32)
    v64 = _flat64(v32, "v")
    if not bool(torch.isfinite(v64).all()):
        raise AssertionError("v must be finite for check_unbiased")
    seeds = range(first_seed, first_seed + num_seeds)
    s = _draw_stochastic(quantize, dequantize, step, v32, v64, seeds, eps, level_slack)
    active = s.delta > 0
    m = int(active.sum())
    if m == 0:
        return
    extra = level_slack * eps * s.delta
    slack = eps * (v64.abs() + s.max_abs_d) + extra + FP32_SUBNORMAL_ABS
    width = s.delta + 2 * slack  # R
    bias = (s.delta * (2.0**-24 + eps) + eps * (2 * v64.abs() + s.delta) + extra
            + FP32_SUBNORMAL_ABS)  # b
    a_each = alpha / 3  # the three tests share alpha (union bound)
    _test_element_means(s, v64, width, bias, active, m, a_each)
    _test_pooled_mean(s, width, bias, active, m, a_each)
    if check_variance:
        _test_second_moments(s, v64, width, active, m, a_each)


@dataclass
class _Draws:
    """Per-element sums over the seeds of a stochastic codec's decoded errors ``d - v``."""

    num_seeds: int
    delta: torch.Tensor       # the step, the same at every seed
    total: torch.Tensor       # sum of (d - v)
    total_sq: torch.Tensor    # sum of (d - v)**2
    max_abs_d: torch.Tensor   # max |d|, for the float slack of the support


def _draw_stochastic(
    quantize: Callable[[torch.Tensor, int], Payload],
    dequantize: Callable[[Payload], torch.Tensor],
    step: Callable[[Payload], torch.Tensor],
    v32: torch.Tensor,
    v64: torch.Tensor,
    seeds: range,
    eps: float,
    level_slack: float,
) -> _Draws:
    """Quantize ``v32`` once per seed, checking every draw deterministically (a step that does
    not depend on the seed, the support, exact zero steps), and sum the errors."""
    n = v32.numel()
    total = torch.zeros(n, dtype=torch.float64)
    total_sq = torch.zeros(n, dtype=torch.float64)
    max_abs_d = torch.zeros(n, dtype=torch.float64)
    delta: torch.Tensor | None = None
    for seed in seeds:
        payload = quantize(v32, seed)
        d = _flat64(dequantize(payload), "dequantize(payload)", n)
        dk = _flat64(step(payload), "step(payload)", n)
        if delta is None:
            delta = dk
        else:
            _check_same_step(delta, dk, seeds.start, seed)
        diff = d - v64
        _check_draw(v64, d, dk, diff, seed, eps, level_slack)
        total += diff
        total_sq += diff * diff
        max_abs_d = torch.maximum(max_abs_d, d.abs())
    assert delta is not None  # num_seeds >= 2
    return _Draws(len(seeds), delta, total, total_sq, max_abs_d)


def _check_same_step(delta: torch.Tensor, dk: torch.Tensor, first_seed: int, seed: int) -> None:
    """The statistics below take one Delta per element: the step must not depend on the seed."""
    if not torch.equal(dk, delta):
        i = int((dk != delta).nonzero()[0])
        raise AssertionError(f"step depends on the seed: element {i} has step "
                             f"{float(delta[i])!r} at seed {first_seed} and "
                             f"{float(dk[i])!r} at seed {seed}")


def _check_draw(v64: torch.Tensor, d: torch.Tensor, dk: torch.Tensor, diff: torch.Tensor,
                seed: int, eps: float, level_slack: float) -> None:
    """One draw: both levels around v lie within Delta (+ float slack) of v, and a zero step
    decodes exactly."""
    slack = eps * (v64.abs() + d.abs()) + level_slack * eps * dk + FP32_SUBNORMAL_ABS
    _fail_first(~(diff.abs() <= dk + slack),
                f"support: |D(Q(v)) - v| <= step + slack (seed {seed})",
                v=v64, decoded=d, step=dk)
    _fail_first((dk == 0) & (diff != 0), f"step 0 must decode exactly (seed {seed})",
                v=v64, decoded=d)


def _test_element_means(s: _Draws, v64: torch.Tensor, width: torch.Tensor, bias: torch.Tensor,
                        active: torch.Tensor, m: int, a_each: float) -> None:
    """Test 1 of :func:`check_unbiased`: per-element z-test, Hoeffding-calibrated, Bonferroni
    over the m elements."""
    big_n = float(s.num_seeds)
    mean_err = s.total / big_n
    c = math.sqrt(2 * math.log(2 * m / a_each))
    z = (mean_err.abs() - bias).clamp_min(0) / (width / (2 * math.sqrt(big_n)))
    _fail_first(active & (z > c),
                f"unbiased: |mean_N(D(Q(v))) - v| within z <= {c:.3f} standard errors "
                f"(N={s.num_seeds}, false-failure probability <= {a_each:.3g})",
                v=v64, mean_decoded=v64 + mean_err, step=s.delta, z=z)


def _test_pooled_mean(s: _Draws, width: torch.Tensor, bias: torch.Tensor, active: torch.Tensor,
                      m: int, a_each: float) -> None:
    """Test 2 of :func:`check_unbiased`: the mean of the normalized errors over all N m
    samples, for a systematic bias too small to see per element."""
    big_n = float(s.num_seeds)
    mean_err = s.total / big_n
    pooled = float((mean_err[active] / width[active]).mean())
    pooled_bias = float((bias[active] / width[active]).mean())
    t = math.sqrt(math.log(2 / a_each) / (2 * big_n * m))
    if abs(pooled) > t + pooled_bias:
        raise AssertionError(
            f"unbiased (pooled over {m} elements x {s.num_seeds} seeds): mean of "
            f"(D(Q(v)) - v) / step = {pooled:.3e}, allowed +-{t + pooled_bias:.3e} "
            f"(false-failure probability <= {a_each:.3g})"
        )


def _test_second_moments(s: _Draws, v64: torch.Tensor, width: torch.Tensor,
                         active: torch.Tensor, m: int, a_each: float) -> None:
    """Test 3 of :func:`check_unbiased`: the per-coordinate second moment (QSGD Lemma 3.1),
    one-sided Hoeffding with Bonferroni over the m elements."""
    big_n = float(s.num_seeds)
    mse = s.total_sq / big_n
    r2 = width * width
    allowed = r2 / 4 + r2 * math.sqrt(math.log(m / a_each) / (2 * big_n))
    _fail_first(active & (mse > allowed),
                f"variance: mean_N((D(Q(v)) - v)**2) <= step**2/4 + Hoeffding margin "
                f"(N={s.num_seeds}, false-failure probability <= {a_each:.3g})",
                v=v64, step=s.delta, mse=mse, allowed=allowed)


# ---------------------------------------------------------------------------------------------
# error feedback


def check_error_feedback_conservation(
    quantize_ef: Callable[[torch.Tensor, torch.Tensor, int], tuple[Payload, torch.Tensor]],
    dequantize: Callable[[Payload], torch.Tensor],
    xs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    error: torch.Tensor | None = None,
    seeds: Sequence[int] | None = None,
    eps: float = FP32_EPS,
) -> None:
    """Error feedback loses nothing: per step ``D(payload_t) + e_t = x_t + e_{t-1}``, and over
    the run ``sum_t D(payload_t) + e_T = sum_t x_t + e_0``, both up to float32 rounding.

    Args:
        quantize_ef: ``(x [n], e_old float32 [n], seed) -> (payload, e_new float32 [n])``; must
            not modify ``e_old`` (the check passes it a copy it keeps).
        dequantize: ``payload -> float [n]``.
        xs: T tensors ``[n]`` (a sequence, or a tensor ``[T, n]``), the inputs of T steps.
        error: float32 ``[n]`` initial residual ``e_0``; zeros if None.
        seeds: T seeds (default ``0 .. T-1``).
        eps: unit roundoff of the codec's arithmetic.

    Bounds. The codec computes ``v = fl(x + e_old)`` and ``e_new = fl(v - d)`` with
    ``d = D(payload)`` exactly as the receiver decodes it. Float addition is exact when its
    result is subnormal, so ``|v - (x + e_old)| <= eps |x + e_old|`` and
    ``|e_new - (v - d)| <= eps |e_new|``. Hence, per element and step::

        |d + e_new - (x + e_old)| <= r_t := eps (|x + e_old| + |e_new|) + 2**-149

    (the 2**-149 term is for codecs that round into the subnormal range some other way).
    Summing the per-step identities telescopes the residuals::

        |sum_t d_t + e_T - e_0 - sum_t x_t| <= sum_t r_t + float64 error of the check

    The check sums in float64; 2T + 2 terms of float32 magnitude add a rounding error of at
    most ``(2T + 2) * 2**-53 * sum |terms|``. A dropped, negated or half-precision residual
    breaks these by ``|e|`` or ``2**-11 |e|``, far above ``eps |e|``.
    """
    eps = check_real("eps", eps, low=0)
    seq = list(xs.unbind(0)) if isinstance(xs, torch.Tensor) else list(xs)
    if not seq:
        return
    n = seq[0].numel()
    seeds = list(range(len(seq))) if seeds is None else list(seeds)
    if len(seeds) != len(seq):
        raise ValueError(f"seeds must have {len(seq)} entries (one per step), got {len(seeds)}")
    e = torch.zeros(n, dtype=torch.float32) if error is None else error.reshape(-1).clone()
    e0 = _flat64(e, "error", n)
    sum_d = torch.zeros(n, dtype=torch.float64)
    sum_x = torch.zeros(n, dtype=torch.float64)
    sum_r = torch.zeros(n, dtype=torch.float64)
    sum_abs = e0.abs().clone()
    for t, (x, seed) in enumerate(zip(seq, seeds, strict=True)):
        x64 = _flat64(x, f"xs[{t}]", n)
        e_old64 = _flat64(e, "e_old", n)
        payload, e_new = quantize_ef(x, e.clone(), seed)
        d = _flat64(dequantize(payload), f"dequantize(payload_{t})", n)
        r = _check_ef_step(t, x64, e_old64, d, _flat64(e_new, f"e_new (step {t})", n), eps)
        sum_d += d
        sum_x += x64
        sum_r += r
        sum_abs += d.abs() + x64.abs()
        e = e_new.reshape(-1).to(torch.float32)
    _check_ef_run(len(seq), sum_d, sum_x, sum_r, sum_abs, e0, _flat64(e, "e_T", n))


def _check_ef_step(t: int, x64: torch.Tensor, e_old64: torch.Tensor, d: torch.Tensor,
                   e_new64: torch.Tensor, eps: float) -> torch.Tensor:
    """Step ``t`` of :func:`check_error_feedback_conservation`:
    ``|d + e_new - (x + e_old)| <= r_t`` (plus the check's own float64 error); returns r_t."""
    target = x64 + e_old64  # float64 sum of two float32 values: error <= 2**-53 |target|
    r = eps * (target.abs() + e_new64.abs()) + FP32_SUBNORMAL_ABS
    gap = (d + e_new64 - target).abs()
    f64 = 4 * _F64_EPS * (d.abs() + e_new64.abs() + x64.abs() + e_old64.abs())
    _fail_first(~(gap <= r + f64),
                f"error feedback, step {t}: |D(payload) + e_new - (x + e_old)| "
                f"<= eps*(|x + e_old| + |e_new|) + 2**-149",
                x=x64, e_old=e_old64, decoded=d, e_new=e_new64, gap=gap, bound=r + f64)
    return r


def _check_ef_run(steps: int, sum_d: torch.Tensor, sum_x: torch.Tensor, sum_r: torch.Tensor,
                  sum_abs: torch.Tensor, e0: torch.Tensor, e_t: torch.Tensor) -> None:
    """The whole run of :func:`check_error_feedback_conservation`: the residuals telescope,
    ``|sum_t d_t + e_T - e_0 - sum_t x_t| <= sum_t r_t`` plus the float64 error of the sums."""
    total_gap = (sum_d + e_t - e0 - sum_x).abs()
    f64_total = (2 * steps + 4) * _F64_EPS * (sum_abs + e_t.abs())
    _fail_first(~(total_gap <= sum_r + f64_total),
                f"error feedback over {steps} steps: |sum D(payload_t) + e_T - e_0 - sum x_t| "
                f"<= sum_t eps*(|x_t + e_t-1| + |e_t|) + float64 error",
                sum_decoded=sum_d, e_T=e_t, e_0=e0, sum_x=sum_x, gap=total_gap,
                bound=sum_r + f64_total)


# ---------------------------------------------------------------------------------------------
# packing


def check_roundtrip(
    pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    unpack: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    nbytes: int | None = None,
    payload: torch.Tensor | None = None,
) -> None:
    """Packing is a bijection between (codes, scales) and payload bytes.

    Checks, exactly (scales bit for bit, so NaN and -0.0 count):

    * ``unpack(pack(codes, scales)) == (codes, scales)``: nothing is lost (injective);
    * ``pack`` output is 1-D uint8 of ``nbytes`` bytes (if given);
    * if ``payload`` is given: ``pack(*unpack(payload)) == payload``: every well-formed payload
      (padding bits zero) is the image of its own codes (onto).

    Args:
        pack: ``(codes int [n], scales float32 [nblocks]) -> uint8 [nbytes]``.
        unpack: ``(payload uint8 [nbytes], n) -> (codes int [n], scales float32 [nblocks])``.
        codes: integer ``[n]``, each in the codec's code range.
        scales: float32 ``[nblocks]``.
        nbytes: expected payload length.
        payload: a well-formed uint8 payload for ``n = codes.numel()`` elements.
    """
    codes = codes.reshape(-1)
    n = codes.numel()
    packed = pack(codes, scales)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise AssertionError(f"pack must return a 1-D uint8 tensor, got "
                             f"{getattr(packed, 'dtype', type(packed))} "
                             f"of shape {tuple(getattr(packed, 'shape', ()))}")
    if nbytes is not None and packed.numel() != nbytes:
        raise AssertionError(f"pack returned {packed.numel()} bytes, expected {nbytes}")
    _check_unpacked(unpack(packed, n), codes, scales, "unpack(pack(codes, scales))")
    if payload is not None:
        again = pack(*unpack(payload, n))
        if again.shape != payload.shape or not torch.equal(again.cpu(), payload.cpu()):
            if again.shape != payload.shape:
                raise AssertionError(f"pack(unpack(payload)) has shape {tuple(again.shape)}, "
                                     f"payload {tuple(payload.shape)}")
            i = int((again.cpu() != payload.cpu()).nonzero()[0])
            raise AssertionError(f"pack(unpack(payload)) differs from payload at byte {i}: "
                                 f"{int(again[i])} != {int(payload[i])}")


def _check_unpacked(got: tuple[torch.Tensor, torch.Tensor], codes: torch.Tensor,
                    scales: torch.Tensor, what: str) -> None:
    got_codes, got_scales = got
    got_codes = got_codes.reshape(-1).cpu().to(torch.int64)
    want_codes = codes.cpu().to(torch.int64)
    if got_codes.shape != want_codes.shape:
        raise AssertionError(f"{what}: {got_codes.numel()} codes, expected {want_codes.numel()}")
    _fail_first(got_codes != want_codes, f"{what} must recover the codes",
                code=want_codes, unpacked=got_codes)
    gs = got_scales.reshape(-1).cpu().to(torch.float32).contiguous()
    ws = scales.reshape(-1).cpu().to(torch.float32).contiguous()
    if gs.shape != ws.shape:
        raise AssertionError(f"{what}: {gs.numel()} scales, expected {ws.numel()}")
    _fail_first(gs.view(torch.int32) != ws.view(torch.int32),
                f"{what} must recover the scales bit for bit", scale=ws, unpacked=gs)


# ---------------------------------------------------------------------------------------------
# adapter for qcomm's own codec


@dataclass(frozen=True)
class QcommCodec:
    """qcomm's codec for one :class:`QuantSpec`, as the callables the checks take.

    ``quantize`` and ``quantize_ef`` go through :func:`qcomm.compress.quantize` (so argument
    checks and the backend choice apply); ``pack`` / ``unpack`` are the wire format's code
    packing (:mod:`qcomm.kernels.reference`).
    """

    spec: QuantSpec

    def quantize(self, v: torch.Tensor, seed: int):
        """float ``[n]`` -> :class:`qcomm.compress.Packed`."""
        from qcomm.compress import quantize

        return quantize(v, self.spec, seed=seed)

    def quantize_ef(self, x: torch.Tensor, error: torch.Tensor, seed: int):
        """``(x [n], e_old float32 [n], seed) -> (Packed, e_new float32 [n])``."""
        from qcomm.compress import quantize

        e_new = torch.empty_like(error)
        return quantize(x, self.spec, error=error, error_out=e_new, seed=seed), e_new

    def dequantize(self, packed) -> torch.Tensor:
        """Packed -> float32 ``[n]`` (float32 whatever the input dtype: no second rounding)."""
        from qcomm.compress import dequantize

        return dequantize(packed, dtype=torch.float32).reshape(-1)

    def __post_init__(self) -> None:
        check_instance("spec", self.spec, QuantSpec, what="a qcomm.compress.QuantSpec")

    @property
    def level_slack(self) -> float:
        """The ``level_slack`` argument of the checks for this spec: 6 for the 2-bit code,
        whose grid position ``k = fl(fl(fl(v / scale) * 1.5) + 1.5)`` rounds three times and
        whose inner levels ``fl(fl(1/3) * scale)`` are not exactly a third of the scale (wire
        format, "The 2-bit code"); 0 for the others (one rounding to ``t = v / scale``, covered
        by the checks' own slack)."""
        return 6.0 if self.spec.bits == 2 else 0.0

    def step(self, packed) -> torch.Tensor:
        """Packed -> ``[n]``: the spacing of the levels around each element. The block scale
        (float32) for bits 1, 4, 8; for 2 bits, whose levels are ``{-1, -1/3, 1/3, 1} * scale``,
        ``2 * scale / 3`` in float64 (relative error 2**-53, far below the checks' slack)."""
        bs = self.spec.block_size
        scales = packed.scales
        if self.spec.bits == 2:
            scales = scales.to(torch.float64) * 2 / 3
        return scales.repeat_interleave(bs)[: packed.numel]

    def pack(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """int codes ``[n]`` in ``[0, 2**bits)``, float32 scales ``[nblocks]`` -> payload."""
        n = codes.numel()
        spec = self.spec
        payload = torch.zeros(packed_nbytes(n, spec), dtype=torch.uint8)
        per = spec.codes_per_byte
        padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8)
        padded[:n] = codes.to(torch.uint8)
        cn = codes_nbytes(n, spec)
        packed_codes = reference._pack(padded, spec, cn)
        payload[: packed_codes.numel()] = packed_codes
        split_payload(payload, n, spec)[1].copy_(scales.to(torch.float32))
        return payload

    def unpack(self, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """payload uint8 ``[packed_nbytes(numel)]`` -> (int32 codes [numel], float32 scales)."""
        if numel == 0:  # nothing to view (a float32 view of an empty byte slice can fail)
            return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.float32)
        codes, scales = split_payload(payload, numel, self.spec)
        return reference.unpack_codes(codes, numel, self.spec), scales.clone()
