"""Every bad input to qcomm.compress raises as documented, naming the argument; non-finite
input raises NonFiniteError and leaves all state bit for bit unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qcomm.compress import (
    AccumulateOverflowError,
    ErrorFeedback,
    NonFiniteError,
    Packed,
    QuantSpec,
    dequant_accumulate,
    dequantize,
    packed_nbytes,
    quantize,
)
from qcomm.kernels.backend import backend_name
from qcomm.kernels.wire_format import codes_nbytes, num_blocks, split_payload
from qcomm.testing.strategies import adversarial_tensors, lengths, quant_specs

SPEC = QuantSpec(4, 32)
FMAX = torch.finfo(torch.float32).max


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QCOMM_BACKEND", raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor (so NaN payloads and -0.0 compare exactly)."""
    return t.clone().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# QuantSpec


@pytest.mark.parametrize(("kwargs", "exc", "name"), [
    ({"bits": 0}, ValueError, "bits"),
    ({"bits": 3}, ValueError, "bits"),
    ({"bits": 16}, ValueError, "bits"),
    ({"bits": True}, TypeError, "bits"),
    ({"bits": 2.0}, TypeError, "bits"),
    ({"block_size": 16}, ValueError, "block_size"),
    ({"block_size": 48}, ValueError, "block_size"),
    ({"block_size": 8192}, ValueError, "block_size"),
    ({"block_size": True}, TypeError, "block_size"),
    ({"block_size": 64.0}, TypeError, "block_size"),
    ({"rounding": "up"}, ValueError, "rounding"),
    ({"rounding": None}, ValueError, "rounding"),
], ids=str)
def test_bad_spec(kwargs: dict, exc: type, name: str) -> None:
    with pytest.raises(exc, match=name):
        QuantSpec(**kwargs)


def test_spec_must_be_quantspec() -> None:
    with pytest.raises(TypeError, match="spec"):
        quantize(torch.zeros(4), {"bits": 4})
    with pytest.raises(TypeError, match="spec"):
        dequant_accumulate(torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(4), "4bit")


# ---------------------------------------------------------------------------------------------
# quantize arguments


@pytest.mark.parametrize("x", [
    torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.bool),
    torch.zeros(4, dtype=torch.complex64), torch.zeros(4, dtype=torch.float64), [1.0, 2.0],
], ids=lambda x: str(getattr(x, "dtype", type(x).__name__)))
def test_bad_x(x: object) -> None:
    with pytest.raises(TypeError, match="x must"):
        quantize(x, SPEC)
    with pytest.raises(TypeError, match="x must"):
        ErrorFeedback().quantize("k", x, SPEC)


def _meta(n: int) -> torch.Tensor:
    return torch.empty(n, device="meta")


@pytest.mark.parametrize("name", ["error", "error_out"])
@pytest.mark.parametrize(("buf", "exc"), [
    (torch.zeros(9), ValueError),                      # wrong numel
    (torch.zeros(10, dtype=torch.float16), TypeError),  # wrong dtype
    (torch.zeros(10, dtype=torch.float64), TypeError),
    (_meta(10), ValueError),                           # wrong device
    (torch.zeros(20)[::2], ValueError),                # non-contiguous
    ("zeros", TypeError),                              # not a tensor
], ids=["numel", "fp16", "fp64", "meta", "strided", "str"])
def test_bad_error_buffers(name: str, buf: object, exc: type) -> None:
    with pytest.raises(exc, match=name):
        quantize(torch.zeros(10), SPEC, **{name: buf})


def test_error_out_aliasing_error() -> None:
    e = torch.zeros(10)
    with pytest.raises(ValueError, match="error_out"):
        quantize(torch.zeros(10), SPEC, error=e, error_out=e)
    with pytest.raises(ValueError, match="error_out"):
        quantize(torch.zeros(10), SPEC, error=e, error_out=e.view(2, 5))


def test_error_out_partial_overlap() -> None:
    """error_out overlapping error by all but one element: a fused kernel would race."""
    buf = torch.zeros(11)
    with pytest.raises(ValueError, match="error_out"):
        quantize(torch.zeros(10), SPEC, error=buf[:10], error_out=buf[1:])


@pytest.mark.parametrize(("out", "exc"), [
    (torch.zeros(packed_nbytes(10, SPEC) + 1, dtype=torch.uint8), ValueError),
    (torch.zeros(packed_nbytes(10, SPEC) - 1, dtype=torch.uint8), ValueError),
    (torch.zeros(packed_nbytes(10, SPEC), dtype=torch.int8), TypeError),
    (torch.zeros(packed_nbytes(10, SPEC)), TypeError),
    (torch.zeros(1, packed_nbytes(10, SPEC), dtype=torch.uint8), ValueError),
    (torch.zeros(2 * packed_nbytes(10, SPEC), dtype=torch.uint8)[::2], ValueError),
    (torch.empty(packed_nbytes(10, SPEC), dtype=torch.uint8, device="meta"), ValueError),
], ids=["long", "short", "int8", "float", "2d", "strided", "meta"])
def test_bad_out(out: torch.Tensor, exc: type) -> None:
    with pytest.raises(exc, match="out"):
        quantize(torch.zeros(10), SPEC, out=out)


@pytest.mark.parametrize(("seed", "exc"), [
    (-1, ValueError), (2**64, ValueError), (2**70, ValueError),
    (1.0, TypeError), (True, TypeError), ("3", TypeError),
], ids=str)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bad_seed(seed: object, exc: type, rounding: str) -> None:
    """Checked in both modes: a bad seed is a bug in the caller even where it is unused."""
    with pytest.raises(exc, match="seed"):
        quantize(torch.zeros(10), QuantSpec(4, 32, rounding), seed=seed)


def test_seed_extremes_accepted() -> None:
    spec = QuantSpec(4, 32, "stochastic")
    for seed in (0, 2**64 - 1):
        quantize(torch.randn(40), spec, seed=seed)


@pytest.mark.parametrize("value", ["cuda", "bogus", "1"])
def test_bad_backend_env(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("QCOMM_BACKEND", value)
    with pytest.raises(ValueError, match="QCOMM_BACKEND"):
        quantize(torch.zeros(10), SPEC)
    with pytest.raises(ValueError, match="QCOMM_BACKEND"):
        backend_name(torch.device("cpu"))


@pytest.mark.parametrize("value", ["", "auto", "reference", " Reference "])
def test_good_backend_env(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("QCOMM_BACKEND", value)
    assert backend_name(torch.device("cpu")) == "reference"


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCOMM_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend_name(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# dequantize / dequant_accumulate arguments


# Each case: a call on a valid Packed ``p`` of 10 elements -> (exception, message).
BAD_DEQUANTIZE = {
    "a raw payload": (lambda p: dequantize(p.payload), TypeError, "packed"),
    "a float64 result": (lambda p: dequantize(p, dtype=torch.float64), TypeError, "dtype"),
    "out of the wrong size": (lambda p: dequantize(p, out=torch.zeros(11)), ValueError, "out"),
    "out not contiguous": (lambda p: dequantize(p, out=torch.zeros(20)[::2]), ValueError, "out"),
    "out of another dtype": (lambda p: dequantize(p, out=torch.zeros(10, dtype=torch.float64)),
                             TypeError, "out"),
    "a short payload": (lambda p: Packed.from_payload(p.payload[:-1], 10, SPEC), ValueError,
                        "payload"),
    "a payload not of bytes": (lambda p: Packed.from_payload(p.payload.to(torch.int8), 10, SPEC),
                               TypeError, "payload"),
}


@pytest.mark.parametrize("case", list(BAD_DEQUANTIZE))
def test_bad_dequantize_args(case: str) -> None:
    call, exc, match = BAD_DEQUANTIZE[case]
    with pytest.raises(exc, match=match):
        call(quantize(torch.randn(10), SPEC))


_N = 10
_NBYTES = packed_nbytes(_N, SPEC)
_GOOD = torch.zeros(2, _NBYTES, dtype=torch.uint8)
# Each case: (payloads, out, weights) -> (exception, message); None takes the good one.
BAD_ACCUMULATE = {
    "payloads of the wrong width": (torch.zeros(2, _NBYTES + 1, dtype=torch.uint8), None, None,
                                    ValueError, "payloads"),
    "payloads not of bytes": (_GOOD.to(torch.int16), None, None, TypeError, "payloads"),
    "payloads of three dims": (_GOOD.unsqueeze(0), None, None, ValueError, "payloads"),
    "payloads as a list": (_GOOD.tolist(), None, None, TypeError, "payloads"),
    "payloads not contiguous": (torch.zeros(_NBYTES, 2, dtype=torch.uint8).t(), None, None,
                                ValueError, "payloads"),
    "payloads on meta": (_GOOD.to("meta"), None, None, ValueError, "payloads"),
    "out in float16": (None, torch.zeros(_N, dtype=torch.float16), None, TypeError, "out"),
    "out not contiguous": (None, torch.zeros(2 * _N)[::2], None, ValueError, "out"),
    "one weight for two": (None, None, [1.0], ValueError, "weights"),
    "three weights for two": (None, None, [1.0, 2.0, 3.0], ValueError, "weights"),
    "a tensor of three weights": (None, None, torch.ones(3), ValueError, "weights"),
    "a nan weight": (None, None, [1.0, float("nan")], ValueError, "weights"),
    "an inf weight": (None, None, [float("inf"), 1.0], ValueError, "weights"),
    "a -inf weight tensor": (None, None, torch.tensor([1.0, -float("inf")]), ValueError,
                             "weights"),
}


@pytest.mark.parametrize("case", list(BAD_ACCUMULATE))
def test_bad_dequant_accumulate_args_raise_and_touch_nothing(case: str) -> None:
    payloads, out, weights, exc, match = BAD_ACCUMULATE[case]
    acc = torch.zeros(_N)
    kwargs = {} if weights is None else {"weights": weights}
    with pytest.raises(exc, match=match):
        dequant_accumulate(_GOOD.clone() if payloads is None else payloads,
                           acc if out is None else out, SPEC, **kwargs)
    if out is None:
        assert torch.equal(acc, torch.zeros(_N))  # the failed call wrote nothing


# ---------------------------------------------------------------------------------------------
# non-finite input: NonFiniteError, state unchanged


@given(data=st.data())
def test_nonfinite_x_leaves_error_unchanged(data: st.DataObject) -> None:
    """x holding NaN/Inf raises NonFiniteError(argument 'x') with the error buffer bitwise
    unchanged: in place, with error_out, and in ErrorFeedback (residual unchanged)."""
    spec = data.draw(quant_specs(), label="spec")
    n = data.draw(lengths(spec.block_size).filter(bool), label="n")
    x = data.draw(adversarial_tensors(n, block_size=spec.block_size, allow_nonfinite=True))
    x[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from(
        [float("nan"), float("inf"), -float("inf")]))
    e = data.draw(adversarial_tensors(n, dtype=torch.float32, block_size=spec.block_size))
    before = _bits(e)
    with pytest.raises(NonFiniteError) as info:
        quantize(x, spec, error=e, seed=1)
    assert info.value.argument == "x" and info.value.blocks
    assert torch.equal(_bits(e), before)
    with pytest.raises(NonFiniteError):
        quantize(x, spec, error=e, error_out=torch.empty(n), seed=1)
    assert torch.equal(_bits(e), before)

    ef = ErrorFeedback()
    ok = torch.randn(x.shape)
    ef.quantize("k", ok, spec, seed=0)
    res = _bits(ef.residual("k"))
    with pytest.raises(NonFiniteError):
        ef.quantize("k", x, spec, seed=1)
    assert torch.equal(_bits(ef.residual("k")), res)
    # and it keeps working afterwards from the same residual
    expected = quantize(ok, spec, error=ef.residual("k").clone(), seed=2).payload
    assert torch.equal(ef.quantize("k", ok, spec, seed=2).payload, expected)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_overflowing_sum_raises(bits: int) -> None:
    """Finite x whose x + error overflows float32 to inf: NonFiniteError, error unchanged,
    the offending block named."""
    spec = QuantSpec(bits, 32)
    x = torch.zeros(100)
    x[70] = FMAX
    e = torch.zeros(100)
    e[70] = FMAX / 2
    before = _bits(e)
    with pytest.raises(NonFiniteError) as info:
        quantize(x, spec, error=e)
    assert info.value.blocks == [2]
    assert torch.equal(_bits(e), before)
    with pytest.raises(NonFiniteError):
        quantize(x, spec, error=e, error_out=torch.zeros(100))
    assert torch.equal(_bits(e), before)
    ef = ErrorFeedback()
    ef.load_state_dict({"residuals": {"k": e}})
    with pytest.raises(NonFiniteError):
        ef.quantize("k", x, spec)
    assert torch.equal(_bits(ef.residual("k")), before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("k_bad", [0, 2])
def test_nonfinite_payload_scale(bad: float, k_bad: int) -> None:
    """A payload carrying a NaN/Inf scale: NonFiniteError(argument 'payloads'), out unchanged
    even where earlier payloads were fine (checked before anything is accumulated)."""
    n = 70
    payloads = torch.stack([quantize(torch.randn(n), SPEC).payload for _ in range(3)])
    scales = payloads[k_bad, -4 * 3:].view(torch.float32)
    scales[1] = bad
    out = torch.randn(n)
    before = _bits(out)
    with pytest.raises(NonFiniteError) as info:
        dequant_accumulate(payloads, out, SPEC, weights=[1.0, 2.0, 3.0])
    assert info.value.argument == "payloads"
    assert info.value.blocks == [k_bad * 3 + 1]
    assert torch.equal(_bits(out), before)


# ---------------------------------------------------------------------------------------------
# small gaps: shape of a received payload, spec of the size helpers, overflow in accumulate


def test_from_payload_shape_must_match_numel() -> None:
    """A shape whose numel is not the payload's numel would make dequantize write a tensor of
    the wrong size: ValueError naming shape."""
    p = quantize(torch.randn(12), SPEC)
    for shape in ((3, 5), (13,), (-3, -4), (0, 12)):
        with pytest.raises(ValueError, match="shape"):
            Packed.from_payload(p.payload, 12, SPEC, shape=shape)
    assert dequantize(Packed.from_payload(p.payload, 12, SPEC, shape=(3, 4))).shape == (3, 4)
    assert Packed.from_payload(p.payload, 12, SPEC).shape == (12,)
    one = quantize(torch.randn(1), SPEC)
    assert dequantize(Packed.from_payload(one.payload, 1, SPEC, shape=())).shape == ()
    empty = quantize(torch.randn(0), SPEC)
    assert Packed.from_payload(empty.payload, 0, SPEC, shape=(0, 5)).shape == (0, 5)


@pytest.mark.parametrize("helper", [packed_nbytes, codes_nbytes, num_blocks])
def test_size_helpers_need_a_spec(helper) -> None:
    with pytest.raises(TypeError, match="spec"):
        helper(10, None)
    with pytest.raises(TypeError, match="spec"):
        helper(10, {"bits": 4})


def _payload_with(scale: float, code: int, spec: QuantSpec, n: int = 64) -> torch.Tensor:
    """A hand-made payload: every code ``code``, every scale ``scale``."""
    p = quantize(torch.zeros(n), spec).payload.clone()
    codes, scales = split_payload(p, n, spec)
    per = 8 // spec.bits
    byte = sum(code << (i * spec.bits) for i in range(per))
    codes.fill_(byte)
    scales.fill_(scale)
    return p


@pytest.mark.parametrize(("case", "weights"), [
    ("huge_weight", [3e38]),
    ("huge_scale", None),
    ("sum_of_two", None),
    ("weighted_sum", [1.0, 0.75]),
])
def test_dequant_accumulate_overflow_raises_and_leaves_out(case: str, weights) -> None:
    """Finite scales and weights whose decoded sum overflows float32: AccumulateOverflowError
    (an OverflowError and a NonFiniteError) naming the blocks of out that would have become
    Inf or NaN, with out bitwise unchanged."""
    spec = QuantSpec(4, 32)
    n = 64
    if case == "huge_weight":
        payloads = quantize(torch.randn(n, generator=torch.Generator().manual_seed(0)) * 3,
                            spec).payload.unsqueeze(0)
    elif case == "huge_scale":
        payloads = _payload_with(FMAX / 2, 14, spec).unsqueeze(0)  # level 7 * FLT_MAX / 2
    else:
        big = quantize(torch.full((n,), FMAX / 1.5), spec).payload
        payloads = torch.stack([big, big])
    out = torch.randn(n)
    before = _bits(out)
    with pytest.raises(AccumulateOverflowError) as info:
        dequant_accumulate(payloads, out, spec, weights=weights)
    assert isinstance(info.value, OverflowError) and isinstance(info.value, NonFiniteError)
    assert info.value.argument == "payloads" and info.value.blocks
    assert "overflow" in str(info.value)
    assert torch.equal(_bits(out), before)


def test_dequant_accumulate_near_the_limit_is_not_an_error() -> None:
    """Sums that only might overflow (by the cheap bound) but do not are computed as usual:
    an 8-bit FLT_MAX block into zeros, and two huge payloads of opposite signs."""
    spec = QuantSpec(8, 32)
    top = quantize(torch.full((32,), FMAX), spec)
    out = torch.zeros(32)
    dequant_accumulate(top.payload, out, spec)
    assert torch.equal(out, dequantize(top)) and bool(torch.isfinite(out).all())
    spec4 = QuantSpec(4, 32)
    plus = quantize(torch.full((32,), FMAX / 1.5), spec4).payload
    minus = quantize(torch.full((32,), -FMAX / 1.5), spec4).payload
    out = torch.ones(32)
    dequant_accumulate(torch.stack([plus, minus]), out, spec4)
    d = dequantize(Packed.from_payload(plus, 32, spec4))
    assert torch.equal(out, (torch.ones(32) + d) - d)


# ---------------------------------------------------------------------------------------------
# messages that say what is wrong


def test_non_contiguous_out_is_named_as_such() -> None:
    p = quantize(torch.randn(512), QuantSpec(4, 128))
    with pytest.raises(ValueError, match=r"out must be contiguous \(it is written in place\), "
                                         r"got a non-contiguous tensor of shape \(512,\)"):
        dequantize(p, out=torch.zeros(1024)[::2])
    with pytest.raises(ValueError, match="out must have 512 elements, got 511"):
        dequantize(p, out=torch.zeros(511))
    with pytest.raises(ValueError, match="out must be on meta, got cpu"):
        dequantize(Packed.from_payload(p.payload.to("meta"), 512, QuantSpec(4, 128)),
                   out=torch.zeros(512))


def test_payload_of_another_spec_names_the_spec_it_fits() -> None:
    p = quantize(torch.randn(512), QuantSpec(4, 128))
    with pytest.raises(ValueError) as info:
        Packed.from_payload(p.payload, 512, QuantSpec(2, 128))
    msg = str(info.value)
    assert msg.startswith("payload must be packed_nbytes(512, spec) = 144 bytes per message "
                          "for 512 values with bits=2, block_size=128, got 272"), msg
    assert "272 bytes fit 512 values under bits=4, block_size=128" in msg
    with pytest.raises(ValueError, match="fit 512 values under bits=4, block_size=128"):
        dequant_accumulate(p.payload, torch.zeros(512), QuantSpec(8, 32))


def test_payload_that_fits_no_spec_says_so() -> None:
    p = quantize(torch.randn(512), QuantSpec(4, 128))
    with pytest.raises(ValueError, match=r"does not match this spec \(numel, bits, block size\) "
                                         r"nor any other spec for 512 values"):
        Packed.from_payload(p.payload[:-1], 512, QuantSpec(4, 128))


# ---------------------------------------------------------------------------------------------
# backends: an interface, chosen once per device type; triton optional


def test_backend_is_chosen_once_per_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm.kernels.backend import CodecBackend, ReferenceBackend, backend_for, reset_backends

    cpu = torch.device("cpu")
    first = backend_for(cpu)
    assert isinstance(first, ReferenceBackend) and isinstance(first, CodecBackend)
    monkeypatch.setenv("QCOMM_BACKEND", "bogus")  # read once: later changes are not seen...
    assert backend_for(cpu) is first
    quantize(torch.zeros(10), SPEC)
    reset_backends()  # ...until the choice is forgotten
    with pytest.raises(ValueError, match="QCOMM_BACKEND must be one of"):
        backend_for(cpu)


def _without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now fails
    monkeypatch.delitem(sys.modules, "qcomm.kernels.triton_codec", raising=False)


def test_without_triton_cuda_tensors_fall_back_to_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qcomm.kernels import backend as backends
    from qcomm.kernels.backend import ReferenceBackend, TritonBackend

    _without_triton(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu\]'"):
        TritonBackend()
    monkeypatch.setattr(backends, "_warned_no_triton", False)
    with pytest.warns(RuntimeWarning, match=r"triton is not installed.*\.\[gpu\]"):
        chosen = backends._choose_backend("cuda")
    assert isinstance(chosen, ReferenceBackend)


def test_forcing_triton_without_it_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_triton(monkeypatch)
    monkeypatch.setenv("QCOMM_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ImportError, match=r"needs triton.*pip install -e '\.\[gpu\]'"):
        quantize(torch.zeros(10), SPEC)


def test_the_cpu_path_never_imports_triton() -> None:
    """Every layer imports, and the codec runs on CPU tensors, where triton cannot be
    imported (a CPU-only install without the gpu extra)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, qcomm.sgd, qcomm.hooks, qcomm.testing.properties\n"
            "from qcomm.compress import QuantSpec, dequantize, quantize\n"
            "x = torch.randn(1000)\n"
            "p = quantize(x, QuantSpec(4, 128, 'stochastic'), seed=1)\n"
            "assert (dequantize(p) - x).abs().max() < 1\n"
            "assert 'qcomm.kernels.triton_codec' not in sys.modules\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
