"""Each property check passes on qcomm's codec and FAILS on a deliberately broken one; a check
that cannot fail proves nothing."""

from __future__ import annotations

import pytest
import torch

from qcomm.compress import QuantSpec
from qcomm.testing.properties import (
    QcommCodec,
    check_error_bound,
    check_error_feedback_conservation,
    check_roundtrip,
    check_unbiased,
)

BS = 32


class ToyCodec:
    """A small 4-bit absmax codec of the kind users write, with switchable flaws.

    Payload: (levels float32 [n], scale float32 [n] per element)."""

    def __init__(self, rounding: str = "nearest", levels: int = 7, clamp: int = 7) -> None:
        self.rounding = rounding
        self.levels = levels  # scale = absmax / levels
        self.clamp = clamp    # |level| <= clamp (the code range)

    def _scale(self, v: torch.Tensor) -> torch.Tensor:
        n = v.numel()
        pad = torch.nn.functional.pad(v, (0, -n % BS)).view(-1, BS)
        return (pad.abs().amax(1) / self.levels).repeat_interleave(BS)[:n]

    def quantize(self, v: torch.Tensor, seed: int):
        v = v.to(torch.float32).reshape(-1)
        s = self._scale(v)
        t = torch.where(s == 0, torch.zeros_like(v), v / s)
        r = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
        q = {
            "nearest": lambda: torch.round(t),
            "floor": lambda: torch.floor(t),
            "stochastic": lambda: torch.floor(t) + (r < t - torch.floor(t)).float(),
            "biased": lambda: torch.floor(t) + (r < 0.9 * (t - torch.floor(t))).float(),
            # unbiased, within one step of v, but variance ~Delta**2 at every element
            "dither": lambda: t + torch.where(r < 0.5, -0.99, 0.99),
        }[self.rounding]()
        if self.rounding != "dither":
            q = q.clamp(-self.clamp, self.clamp)
        return q, s

    def dequantize(self, payload) -> torch.Tensor:
        q, s = payload
        return q * s

    def step(self, payload) -> torch.Tensor:
        return payload[1]

    def quantize_ef(self, x: torch.Tensor, e: torch.Tensor, seed: int, flaw: str = ""):
        v = x.to(torch.float32).reshape(-1) + e
        payload = self.quantize(v, seed)
        e_new = v - self.dequantize(payload)
        if flaw == "dropped":
            e_new = torch.zeros_like(e_new)
        elif flaw == "stale":
            e_new = e.clone()
        elif flaw == "negated":
            e_new = -e_new
        elif flaw == "fp16":
            e_new = e_new.half().float()
        return payload, e_new


class TwoBitCodec:
    """A 2-bit absmax codec with levels {-1, -1/3, 1/3, 1} * s (s = block absmax) in float64,
    and flawed variants of it. Payload: (decoded float64 [n], scale float64 [n]).

    Flaws: "ternary" (the old symmetric code, levels {-1, 0, 1} * s), "inner_half" (inner
    levels decoded at +-s/2 but chosen as if at +-s/3), "floor" (rounds the grid position
    down), "biased" (stochastic, rounds up with 0.9 times the right probability)."""

    def __init__(self, rounding: str = "nearest", flaw: str = "") -> None:
        self.rounding = rounding
        self.flaw = flaw

    def quantize(self, v: torch.Tensor, seed: int):
        v = v.to(torch.float64).reshape(-1)
        n = v.numel()
        pad = torch.nn.functional.pad(v, (0, -n % BS)).view(-1, BS)
        s = pad.abs().amax(1).repeat_interleave(BS)[:n]
        r = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype)
        top = 2 if self.flaw == "ternary" else 3  # grid codes 0..top
        k = torch.where(s == 0, torch.zeros_like(v), v / torch.where(s == 0, 1.0, s))
        k = (k + 1) * top / 2
        frac = k - torch.floor(k)
        if self.flaw == "floor":
            c = torch.floor(k)
        elif self.rounding == "nearest":
            c = torch.round(k)
        else:
            c = torch.floor(k) + (r < (0.9 if self.flaw == "biased" else 1) * frac).to(v.dtype)
        level = c * 2 / top - 1  # in [-1, 1]
        if self.flaw == "inner_half":
            level = torch.where(level.abs() < 1, level * 1.5, level)
        return level * s, s

    def dequantize(self, payload) -> torch.Tensor:
        return payload[0]

    def step(self, payload) -> torch.Tensor:
        return payload[1] * 2 / 3  # the spacing of the four levels


def _vec(n: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 3, n)


# ---------------------------------------------------------------------------------------------
# error bound


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound_passes(bits: int) -> None:
    c = QcommCodec(QuantSpec(bits, BS))
    check_error_bound(c.quantize, c.dequantize, _vec(), step=c.step, level_slack=c.level_slack)
    toy = ToyCodec()
    check_error_bound(toy.quantize, toy.dequantize, _vec(), step=toy.step)
    two = TwoBitCodec()
    check_error_bound(two.quantize, two.dequantize, _vec(), step=two.step)


def test_two_bit_step_is_two_thirds_of_the_scale() -> None:
    """QcommCodec's 2-bit step is the level spacing 2 * scale / 3, so the bound is scale / 3
    (not scale / 2, which the old ternary code met)."""
    c = QcommCodec(QuantSpec(2, BS))
    p = c.quantize(_vec(), 0)
    want = p.scales.to(torch.float64).repeat_interleave(BS)[:200] * 2 / 3
    assert torch.equal(c.step(p), want)
    assert QcommCodec(QuantSpec(4, BS)).level_slack == 0.0 and c.level_slack == 6.0


@pytest.mark.parametrize("flaw", ["ternary", "inner_half", "floor"])
def test_two_bit_error_bound_fails(flaw: str) -> None:
    """With the 2-bit step (bound scale/3), the ternary code (error up to scale/2), inner levels
    at +-scale/2 (error up to scale/2 at v = 0) and floor rounding (up to 2 scale/3) fail.
    The ternary code passes a bound of scale/2: the step, not the slack, makes it fail."""
    codec = TwoBitCodec(flaw=flaw)
    with pytest.raises(AssertionError, match=r"first element \d+: v="):
        check_error_bound(codec.quantize, codec.dequantize, _vec(), step=codec.step,
                          level_slack=6.0)
    if flaw == "ternary":
        check_error_bound(codec.quantize, codec.dequantize, _vec(),
                          step=lambda p: p[1])  # step = scale: bound scale/2, met


def test_two_bit_qcomm_codec_fails_when_broken() -> None:
    """qcomm's own 2-bit payloads decoded with the inner levels at +-scale/2 (a decoder that
    takes the code for a uniform grid over [-s, s] in halves) fail the error bound."""
    c = QcommCodec(QuantSpec(2, BS))
    v = _vec()
    v[::BS] = 0.0  # v = 0 takes an inner level: off by scale/2 - scale/3 = scale/6 more

    def wrong_inner(p):
        d = c.dequantize(p).clone()
        s = p.scales.repeat_interleave(BS)[: p.numel]
        return torch.where(d.abs() < s, d * 1.5, d)

    check_error_bound(c.quantize, c.dequantize, v, step=c.step, level_slack=c.level_slack)
    with pytest.raises(AssertionError, match="level_slack"):
        check_error_bound(c.quantize, wrong_inner, v, step=c.step, level_slack=c.level_slack)


@pytest.mark.parametrize("codec", [ToyCodec("floor"), ToyCodec("stochastic"), ToyCodec(levels=8)],
                         ids=["floor", "stochastic", "scale-one-level-small"])
def test_error_bound_fails(codec: ToyCodec) -> None:
    """Floor rounding, stochastic rounding, a scale of absmax/8 with levels clamped to 7 (the
    absmax element is off by a whole step)."""
    with pytest.raises(AssertionError, match=r"first element \d+: v="):
        check_error_bound(codec.quantize, codec.dequantize, _vec(), step=codec.step)


def test_error_bound_slack_is_tight() -> None:
    """A codec off by 8 ulps of |v| at one element already fails: the slack is ulps, not %."""
    c = QcommCodec(QuantSpec(4, BS))
    v = torch.full((BS,), 1.0)
    v[3] = 0.5  # halfway between levels 3 and 4 (scale 1/7): error scale/2 up to rounding

    def nudged(p):
        d = c.dequantize(p).clone()
        d[3] = d[3] + 8 * 2.0**-24 * float(d[3]) * (1 if float(d[3]) > float(v[3]) else -1)
        return d

    check_error_bound(c.quantize, c.dequantize, v, step=c.step)
    with pytest.raises(AssertionError, match="first element 3"):
        check_error_bound(c.quantize, nudged, v, step=c.step)


# ---------------------------------------------------------------------------------------------
# unbiasedness (each passing call: false-failure probability <= alpha = 1e-6)


def test_unbiased_passes() -> None:
    toy = ToyCodec("stochastic")
    check_unbiased(toy.quantize, toy.dequantize, _vec(), step=toy.step, num_seeds=300)
    c = QcommCodec(QuantSpec(2, BS, "stochastic"))
    check_unbiased(c.quantize, c.dequantize, _vec(), step=c.step, num_seeds=300,
                   level_slack=c.level_slack)
    two = TwoBitCodec("stochastic")
    check_unbiased(two.quantize, two.dequantize, _vec(), step=two.step, num_seeds=300)


@pytest.mark.parametrize(("rounding", "flaw", "match"), [
    ("nearest", "", "unbiased"),          # bias up to the step / 2: per element
    ("stochastic", "biased", "pooled"),   # 0.1 * frac * step: seen pooled
    ("stochastic", "inner_half", "support"),  # inner levels s apart: more than 2s/3
    ("stochastic", "ternary", "support"),     # neighbours s apart
])
def test_two_bit_unbiased_fails(rounding: str, flaw: str, match: str) -> None:
    codec = TwoBitCodec(rounding, flaw)
    with pytest.raises(AssertionError, match=match):
        check_unbiased(codec.quantize, codec.dequantize, _vec(), step=codec.step,
                       num_seeds=300, level_slack=6.0)


@pytest.mark.parametrize(("rounding", "match"), [
    ("nearest", "unbiased"),   # bias up to Delta/2: the per-element test
    ("biased", "pooled"),      # bias 0.1 * frac * Delta: too small per element, seen pooled
    ("dither", "variance"),    # unbiased, support within Delta, but variance Delta**2
], ids=["nearest", "biased", "dither"])
def test_unbiased_fails(rounding: str, match: str) -> None:
    toy = ToyCodec(rounding)
    with pytest.raises(AssertionError, match=match):
        check_unbiased(toy.quantize, toy.dequantize, _vec(), step=toy.step, num_seeds=300)


def test_unbiased_support_and_seed_dependent_step() -> None:
    toy = ToyCodec("stochastic")
    with pytest.raises(AssertionError, match="support"):  # decodes two levels off
        check_unbiased(toy.quantize, lambda p: (p[0] + 2 * (p[0] < 0)) * p[1], _vec(),
                       step=toy.step, num_seeds=10)
    with pytest.raises(AssertionError, match="depends on the seed"):
        check_unbiased(lambda v, s: toy.quantize(v * (1 + s), s), toy.dequantize, _vec(),
                       step=toy.step, num_seeds=10)


# ---------------------------------------------------------------------------------------------
# error feedback


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_feedback_passes(rounding: str) -> None:
    xs = torch.stack([_vec(seed=s) for s in range(6)])
    toy = ToyCodec(rounding)
    check_error_feedback_conservation(toy.quantize_ef, toy.dequantize, xs)
    for bits in (1, 2, 4, 8):
        c = QcommCodec(QuantSpec(bits, BS, rounding))
        check_error_feedback_conservation(c.quantize_ef, c.dequantize, xs, error=_vec(seed=9))


@pytest.mark.parametrize("flaw", ["dropped", "stale", "negated", "fp16"])
def test_error_feedback_fails(flaw: str) -> None:
    """A dropped, stale, negated or half-precision residual breaks the per-step identity; the
    fp16 residual (error 2**-11 |e|) shows the bound is float32-tight."""
    toy = ToyCodec()
    xs = torch.stack([_vec(seed=s) for s in range(4)])
    with pytest.raises(AssertionError, match=r"error feedback, step \d"):
        check_error_feedback_conservation(
            lambda x, e, s: toy.quantize_ef(x, e, s, flaw), toy.dequantize, xs)


def test_error_feedback_multi_step_catches_drift() -> None:
    """A residual that leaks 1e-4 of itself per step (a slow drift, not a dropped residual)
    already exceeds the float32 bound."""
    toy = ToyCodec()
    xs = torch.stack([_vec(seed=s) for s in range(4)])

    def leaky(x, e, s):
        p, e_new = toy.quantize_ef(x, e, s)
        return p, e_new * (1 + 1e-4)

    with pytest.raises(AssertionError, match="error feedback"):
        check_error_feedback_conservation(leaky, toy.dequantize, xs)


# ---------------------------------------------------------------------------------------------
# packing


def _codes_scales(bits: int, n: int = 77) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    codes[5] = (1 << bits) - 1
    return codes, torch.randn(-(-n // BS), generator=g)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_roundtrip_passes(bits: int) -> None:
    c = QcommCodec(QuantSpec(bits, BS))
    codes, scales = _codes_scales(bits)
    check_roundtrip(c.pack, c.unpack, codes, scales, payload=c.pack(codes, scales))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("flaw", ["off_by_one", "drop_top_bit", "scale_bytes_swapped"])
def test_roundtrip_fails(bits: int, flaw: str) -> None:
    c = QcommCodec(QuantSpec(bits, BS))
    codes, scales = _codes_scales(bits)

    def pack(cd: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
        if flaw == "off_by_one":  # element i written at slot i + 1
            cd = torch.cat([cd[-1:], cd[:-1]])
        elif flaw == "drop_top_bit":
            cd = cd & ((1 << bits) - 1 >> 1)
        p = c.pack(cd, sc)
        if flaw == "scale_bytes_swapped":
            n = cd.numel()
            tail = p[-4 * sc.numel():].view(-1, 4).flip(1).reshape(-1)
            p = torch.cat([p[: p.numel() - tail.numel()], tail]) if n else p
        return p

    with pytest.raises(AssertionError, match=r"must recover the (codes|scales)"):
        check_roundtrip(pack, c.unpack, codes, scales)


def test_roundtrip_fails_on_wrong_length_and_non_surjective_pack() -> None:
    c = QcommCodec(QuantSpec(4, BS))
    codes, scales = _codes_scales(4)
    with pytest.raises(AssertionError, match="bytes, expected"):
        check_roundtrip(c.pack, c.unpack, codes, scales, nbytes=3)
    payload = c.pack(codes, scales)

    def dirty_pack(cd, sc):  # sets an alignment-padding bit: pack(unpack(p)) != p
        p = c.pack(cd, sc)
        p[-4 * sc.numel() - 1] |= 0x80
        return p

    with pytest.raises(AssertionError, match="differs from payload"):
        check_roundtrip(dirty_pack, c.unpack, codes, scales, payload=payload)


def test_the_checks_slack_and_the_codecs_spec_are_named_when_wrong() -> None:
    """A negative slack failed a correct codec, the failure reading as the codec's; a spec
    that is no QuantSpec failed at the first call, naming nothing."""
    c = QcommCodec(QuantSpec(4, BS, "nearest"))
    v = torch.randn(2 * BS, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="eps must be a finite float >= 0, got -1"):
        check_error_bound(c.quantize, c.dequantize, v, step=c.step, eps=-1)
    with pytest.raises(ValueError, match="level_slack must be a finite float >= 0"):
        check_unbiased(c.quantize, c.dequantize, v, step=c.step, num_seeds=4,
                       level_slack=float("nan"))
    with pytest.raises(ValueError, match="eps must be"):
        check_error_feedback_conservation(c.quantize_ef, c.dequantize, [v], eps=-1e-7)
    with pytest.raises(TypeError, match=r"spec must be a qcomm\.compress\.QuantSpec, got 4"):
        QcommCodec(4)
