"""qcomm.compress without a host sync: ``non_blocking=True`` calls read nothing on the host,
give the blocking call's bits, and raise its errors from ``wait()`` / ``commit()`` with the
same state left untouched; the blocking dequant_accumulate reads its checks once, after the
launch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qcomm import compress
from qcomm.compress import (
    AccumulateOverflowError,
    DeferredCheck,
    ErrorFeedback,
    NonFiniteError,
    QuantSpec,
    decode,
    dequant_accumulate,
    dequantize,
    quantize,
    unchecked,
)
from qcomm.kernels.wire_format import split_payload

SPEC = QuantSpec(4, 32, "stochastic")
FMAX = torch.finfo(torch.float32).max
# What reads a tensor's values on the host: a sync on an accelerator.
HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu",
              "nonzero")


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QCOMM_BACKEND", raising=False)


class _Backend:
    """A codec backend whose calls the spy below does not count: the kernels are the
    backend's business (the reference reads its guard on the host, free on a CPU; a compiled
    Triton kernel reads nothing there), the checks around them are the API's."""

    def __init__(self, real: object, inside: list[bool]) -> None:
        self._real, self._inside = real, inside

    def __getattr__(self, name: str):
        method = getattr(self._real, name)

        def call(*a, **kw):
            self._inside.append(True)
            try:
                return method(*a, **kw)
            finally:
                self._inside.pop()

        return call


@contextlib.contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch, *, allowed: int = 0) -> Iterator[list[str]]:
    """Count the API's host reads of tensor values inside the block (not the backend's); more
    than ``allowed`` fail at the read that exceeds it (with its name)."""
    seen: list[str] = []
    inside: list[bool] = []
    with monkeypatch.context() as m:
        real_backend_for = unchecked.backend_for
        m.setattr(unchecked, "backend_for", lambda d: _Backend(real_backend_for(d), inside))
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def spy(self, *a, _real=real, _name=name, **kw):
                if not inside:
                    seen.append(_name)
                    if len(seen) > allowed:
                        raise AssertionError(f"host read {_name} #{len(seen)} "
                                             f"(allowed {allowed})")
                return _real(self, *a, **kw)

            m.setattr(torch.Tensor, name, spy)
        yield seen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.clone().view(torch.int32)


def _payloads(n: int, k: int, spec: QuantSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + k)
    return torch.stack([quantize(torch.randn(n, generator=g), spec, seed=i).payload
                        for i in range(k)])


# What launches no device work: views, allocations, reads (counted above).
NOT_LAUNCHES = ("aten.view", "aten.slice", "aten.detach", "aten.alias", "aten.reshape",
                "aten.unsqueeze", "aten.empty", "aten._local_scalar_dense")


class _DeviceOps(TorchDispatchMode):
    """The torch ops that a codec call dispatches outside its backend, launches only."""

    def __init__(self, inside: list[bool]) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._inside = inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self._inside and not name.startswith(NOT_LAUNCHES):
            self.ops.append(name.split(".")[1])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def device_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the device ops the API launches inside the block, besides its backend's."""
    inside: list[bool] = []
    real_backend_for = unchecked.backend_for
    with monkeypatch.context() as m:
        m.setattr(unchecked, "backend_for", lambda d: _Backend(real_backend_for(d), inside))
        with _DeviceOps(inside) as mode:
            yield mode.ops


# ---------------------------------------------------------------------------------------------
# quantize


@pytest.mark.parametrize("mode", ["none", "in_place", "error_out"])
def test_non_blocking_quantize_reads_nothing_and_gives_the_blocking_bits(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    err = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.1
    kwargs = {"none": {}, "in_place": {"error": err.clone()},
              "error_out": {"error": err.clone(), "error_out": torch.empty(n)}}
    want_kw = {k: v.clone() for k, v in kwargs[mode].items()}
    want = quantize(x, SPEC, seed=7, **want_kw)
    got_kw = kwargs[mode]
    with host_reads(monkeypatch):
        got = quantize(x, SPEC, seed=7, non_blocking=True, **got_kw)
    assert got.wait() is got
    assert torch.equal(got.payload, want.payload)
    for name in got_kw:
        assert torch.equal(_bits(got_kw[name]), _bits(want_kw[name])), name
    assert got.deferred is not None and want.deferred is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_blocking_quantize_of_a_nonfinite_input_raises_at_wait_and_keeps_error(
        bad: float) -> None:
    n = 200
    x = torch.randn(n)
    x[[5, 170]] = bad
    err = torch.randn(n) * 0.1
    before = _bits(err)
    with pytest.raises(NonFiniteError) as blocking:
        quantize(x, SPEC, error=err.clone())
    packed = quantize(x, SPEC, error=err, non_blocking=True)  # no raise: nothing was read
    assert torch.equal(_bits(err), before)  # the in-place residual moved on the device? no
    for _ in range(2):  # read again, the verdict says the same
        with pytest.raises(NonFiniteError) as info:
            packed.wait()
        assert info.value.argument == "x" and info.value.blocks == blocking.value.blocks
    assert info.value.blocks == [0, 5]


def test_the_verdict_is_the_calls_even_when_its_payload_is_overwritten_before_wait() -> None:
    """The check is made at the call (on the device) and only read at wait(): a healthy payload
    written into the same ``out`` in between changes no verdict, it only hides which blocks
    were bad, and the error says so."""
    n = 200
    x = torch.randn(n)
    x[7] = float("nan")
    out = torch.empty(compress.packed_nbytes(n, SPEC), dtype=torch.uint8)
    packed = quantize(x, SPEC, seed=1, out=out, non_blocking=True)
    healthy = quantize(torch.randn(n), SPEC, seed=1, out=out, non_blocking=True)
    assert healthy.wait() is healthy
    with pytest.raises(NonFiniteError, match="cannot be named") as info:
        packed.wait()
    assert info.value.blocks == []


def test_non_blocking_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="non_blocking must be True or False, got 1"):
        quantize(torch.randn(8), SPEC, non_blocking=1)
    out = torch.zeros(64)
    with pytest.raises(TypeError, match="non_blocking must be True or False, got 'yes'"):
        dequant_accumulate(_payloads(64, 1), out, SPEC, non_blocking="yes")
    assert torch.equal(out, torch.zeros(64))


# ---------------------------------------------------------------------------------------------
# ErrorFeedback


def test_error_feedback_non_blocking_needs_a_deferred_commit() -> None:
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="non_blocking=True needs commit=False"):
        ef.quantize("k", torch.randn(64), SPEC, non_blocking=True)
    assert "k" not in ef


def test_error_feedback_non_blocking_commits_the_blocking_residual(
        monkeypatch: pytest.MonkeyPatch) -> None:
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    blocking, deferred = ErrorFeedback(), ErrorFeedback()
    for step, x in enumerate(xs):
        want = blocking.quantize("k", x, SPEC, seed=step)
        with host_reads(monkeypatch):
            got = deferred.quantize("k", x, SPEC, seed=step, commit=False, non_blocking=True)
        deferred.commit("k")
        assert torch.equal(got.payload, want.payload)
        assert torch.equal(_bits(deferred.residual("k")), _bits(blocking.residual("k")))


def test_error_feedback_commit_raises_for_a_nonfinite_input_and_keeps_the_residual() -> None:
    ef = ErrorFeedback()
    ef.quantize("k", torch.randn(100), SPEC, seed=1)
    before = _bits(ef.residual("k"))
    x = torch.randn(100)
    x[40] = float("nan")
    ef.quantize("k", x, SPEC, seed=2, commit=False, non_blocking=True)
    with pytest.raises(NonFiniteError) as info:
        ef.commit("k")
    assert info.value.blocks == [1]
    assert torch.equal(_bits(ef.residual("k")), before)
    ef.commit("k")  # nothing pending any more: a no-op
    assert torch.equal(_bits(ef.residual("k")), before)
    healthy = ef.quantize("k", torch.randn(100), SPEC, seed=3)  # the key goes on as usual
    assert healthy.wait() is healthy


# ---------------------------------------------------------------------------------------------
# dequant_accumulate


@pytest.mark.parametrize("weights", [None, [0.5, -0.25, 1 / 3], "tensor"])
def test_non_blocking_accumulate_reads_nothing_and_gives_the_blocking_bits(
        weights, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 250
    payloads = _payloads(n, 3)
    if weights == "tensor":
        weights = torch.tensor([0.5, 2.0, -1.0])
    out0 = torch.randn(n)
    want = dequant_accumulate(payloads, out0.clone(), SPEC, weights)
    got = out0.clone()
    dequant_accumulate(payloads, got.clone(), SPEC, weights)  # sequence weights: now cached
    with host_reads(monkeypatch):
        check = dequant_accumulate(payloads, got, SPEC, weights, non_blocking=True)
    assert isinstance(check, DeferredCheck)
    check.wait()
    assert check.ok()
    assert torch.equal(_bits(got), _bits(want))


def test_blocking_accumulate_reads_once_after_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel is launched before the check is read, so the host's launch overlaps the
    device's work: one read, after the kernel call."""
    events: list[str] = []
    real = decode.dequant_accumulate_into

    def launch(*a, **kw):
        events.append("launch")
        return real(*a, **kw)

    monkeypatch.setattr(decode, "dequant_accumulate_into", launch)
    out = torch.zeros(128)
    payloads = _payloads(128, 2)
    with host_reads(monkeypatch, allowed=1) as reads:
        dequant_accumulate(payloads, out, SPEC, [0.5, 0.5])
        events += reads
    assert events == ["launch", "__bool__"]


@pytest.mark.parametrize("where", ["scale", "weight"])
def test_non_blocking_accumulate_refuses_nonfinite_input_unwritten(where: str) -> None:
    n = 96
    payloads = _payloads(n, 3)
    weights = torch.tensor([1.0, 0.5, 0.25])
    if where == "scale":
        split_payload(payloads, n, SPEC)[1][1, 2] = float("nan")
    else:
        weights[2] = float("inf")
    want_type = NonFiniteError if where == "scale" else ValueError
    out = torch.randn(n)
    before = _bits(out)
    with pytest.raises(want_type) as blocking:
        dequant_accumulate(payloads, out, SPEC, weights)
    assert torch.equal(_bits(out), before)
    check = dequant_accumulate(payloads, out, SPEC, weights, non_blocking=True)
    assert torch.equal(_bits(out), before)
    assert not check.ok()
    with pytest.raises(want_type) as info:
        check.wait()
    assert str(info.value) == str(blocking.value)
    if where == "scale":
        assert info.value.blocks == [1 * 3 + 2]


def test_a_sum_that_might_overflow_is_computed_when_blocking_and_refused_when_not() -> None:
    """Near float32's limit the cheap bound fails: the blocking call sums aside and writes the
    finite result; the non-blocking one cannot look, so it refuses and writes nothing."""
    spec = QuantSpec(8, 32)
    top = quantize(torch.full((32,), FMAX), spec)
    out = torch.zeros(32)
    dequant_accumulate(top.payload, out, spec)
    assert torch.equal(out, dequantize(top))
    out = torch.zeros(32)
    check = dequant_accumulate(top.payload, out, spec, non_blocking=True)
    with pytest.raises(AccumulateOverflowError, match=r"might overflow.*nothing was written"):
        check.wait()
    assert torch.equal(out, torch.zeros(32))


def test_an_empty_accumulate_has_nothing_to_check() -> None:
    out = torch.zeros(0)
    check = dequant_accumulate(_payloads(0, 2), out, SPEC, non_blocking=True)
    check.wait()
    assert check.ok()


@pytest.mark.parametrize(("weights", "error", "match"), [
    ([1.0, True], TypeError, "weights must be a sequence of K = 2 real numbers"),
    ("ab", TypeError, "weights must be a sequence of K = 2 real numbers"),
    ([1.0], ValueError, "weights must have K = 2 entries"),
    ([1.0, float("nan")], ValueError, r"weights must be finite, got \[1.0, nan\]"),
    (torch.ones(3), ValueError, "weights must have K = 2 entries"),
    (torch.tensor([1.0, 2.0j]), TypeError, "a tensor of K real values, got a tensor of dtype"),
    (torch.tensor([True, False]), TypeError, "got a tensor of dtype torch.bool"),
])
def test_bad_weights_are_named_and_out_kept(weights, error, match) -> None:
    out = torch.randn(64)
    before = _bits(out)
    with pytest.raises(error, match=match):
        dequant_accumulate(_payloads(64, 2), out, SPEC, weights)
    assert torch.equal(_bits(out), before)


def test_a_zero_weights_sign_is_its_own_not_a_cached_calls() -> None:
    """-0.0 == 0.0 as a cache key: weights [-0.0] after [0.0] must still multiply by -0.0
    (over an out of -0.0 and a payload decoding to +0.0 the sum's sign shows it)."""
    spec = QuantSpec(4, 32)
    payload = quantize(torch.zeros(32), spec).payload
    for weights in ([0.0], [-0.0], [0.0]):
        got, want = torch.full((32,), -0.0), torch.full((32,), -0.0)
        dequant_accumulate(payload, got, spec, weights)
        dequant_accumulate(payload, want, spec, torch.tensor(weights))
        assert torch.equal(_bits(got), _bits(want)), weights


def test_weights_as_a_numpy_array_or_a_tensor_give_the_sequence_bits() -> None:
    payloads = _payloads(64, 2)
    outs = [torch.ones(64) for _ in range(3)]
    for out, w in zip(outs, ([0.5, 0.25], np.array([0.5, 0.25]), torch.tensor([0.5, 0.25])),
                      strict=True):
        dequant_accumulate(payloads, out, SPEC, w)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---------------------------------------------------------------------------------------------
# on a GPU: torch's own sync detector


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh)")
def test_non_blocking_calls_make_no_cuda_sync() -> None:
    n = 1 << 16
    x = torch.randn(n, device="cuda")
    err = torch.zeros(n, device="cuda")
    ef = ErrorFeedback()
    payloads = _payloads(n, 4).cuda()
    out = torch.zeros(n, device="cuda")
    weights = [0.25] * 4
    dequant_accumulate(payloads, out, SPEC, weights)  # the first call copies the weights over
    ef.quantize("k", x, SPEC, seed=1)  # makes the residual buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = quantize(x, SPEC, error=err, seed=1, non_blocking=True)
        pending = ef.quantize("k", x, SPEC, seed=2, commit=False, non_blocking=True)
        check = dequant_accumulate(payloads, out, SPEC, weights, non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    packed.wait()
    pending.wait()
    check.wait()
    ef.commit("k")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh)")
def test_non_blocking_calls_replay_in_a_cuda_graph_with_the_eager_bits_and_checks() -> None:
    """A non-blocking quantize and accumulate captured in one CUDA graph: each replay gives the
    eager calls' bits, and the captured calls' wait() reads that replay's verdicts (a NaN fed
    to a later replay raises there, naming its block)."""
    n = 1 << 16
    x = torch.randn(n, device="cuda")
    err = torch.randn(n, device="cuda") * 0.1
    err_out = torch.empty_like(err)
    payload = torch.empty(compress.packed_nbytes(n, SPEC), dtype=torch.uint8, device="cuda")
    payloads = _payloads(n, 4).cuda()
    out = torch.zeros(n, device="cuda")
    weights = [0.25] * 4

    def calls() -> tuple[compress.Packed, DeferredCheck]:
        return (quantize(x, SPEC, error=err, error_out=err_out, seed=1, out=payload,
                         non_blocking=True),
                dequant_accumulate(payloads, out, SPEC, weights, non_blocking=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch's graphs ask
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    out.zero_()
    packed, check = calls()
    packed.wait()
    check.wait()
    want = [t.clone() for t in (payload, err_out, out)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_check = calls()
    out.zero_()
    graph.replay()
    captured.wait()
    captured_check.wait()
    for got, w, name in zip((payload, err_out, out), want, ("payload", "error_out", "out"),
                            strict=True):
        assert torch.equal(got, w), name
    x[200] = float("nan")  # block 6 of 32 values
    graph.replay()
    with pytest.raises(NonFiniteError) as info:
        captured.wait()
    assert info.value.blocks == [200 // 32]


# ---------------------------------------------------------------------------------------------
# launches per call: each costs the host a few microseconds on a GPU


@pytest.mark.parametrize(("call", "want"), [
    ("quantize", ["linalg_vector_norm"]),
    ("quantize_non_blocking", ["linalg_vector_norm"]),
    ("quantize_in_place_non_blocking", ["linalg_vector_norm", "le", "where"]),
    ("accumulate", ["linalg_vector_norm"]),
    ("accumulate_non_blocking", ["linalg_vector_norm"]),
    ("accumulate_weights_non_blocking", ["linalg_vector_norm"]),
])
def test_a_call_launches_its_kernel_and_one_reduction(
        call: str, want: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside its backend, a healthy call launches one reduction (the largest scale) and
    nothing else: no isfinite/all chain, no bound computed apart from the kernel, no weights
    copied (the sequence's tensor is cached after its first call)."""
    n = 4096
    x, err, err_out = torch.randn(n), torch.zeros(n), torch.empty(n)
    out, payloads = torch.zeros(n), _payloads(n, 3)
    calls = {
        "quantize": lambda: quantize(x, SPEC, error=err, error_out=err_out, seed=1),
        "quantize_non_blocking": lambda: quantize(x, SPEC, error=err, error_out=err_out,
                                                  seed=1, non_blocking=True),
        "quantize_in_place_non_blocking": lambda: quantize(x, SPEC, error=err, seed=1,
                                                           non_blocking=True),
        "accumulate": lambda: dequant_accumulate(payloads, out, SPEC),
        "accumulate_non_blocking": lambda: dequant_accumulate(payloads, out, SPEC,
                                                              non_blocking=True),
        "accumulate_weights_non_blocking": lambda: dequant_accumulate(
            payloads, out, SPEC, [0.5, 0.25, 0.25], non_blocking=True),
    }
    calls[call]()  # the first call fills the weights cache
    with device_ops(monkeypatch) as ops:
        calls[call]()
    assert ops == want
