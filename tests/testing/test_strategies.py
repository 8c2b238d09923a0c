"""The strategies draw what they promise: finite by default, every dtype, every block kind
(checked on the generator directly and by hypothesis.find), lengths biased to block edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from qcomm.compress import QuantSpec
from qcomm.testing import strategies as S
from qcomm.testing.strategies import (
    FLOAT_DTYPES,
    KINDS,
    adversarial_tensors,
    lengths,
    quant_specs,
    seeds,
)

FIND = settings(max_examples=2000, database=None)


@given(data=st.data())
def test_finite_shape_dtype(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    n = data.draw(lengths(32))
    x = data.draw(adversarial_tensors(n, dtype=dtype, block_size=32))
    assert x.shape == (n,) and x.dtype == dtype and x.is_contiguous()
    assert bool(torch.isfinite(x).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind(kind: str, dtype: torch.dtype) -> None:
    """Every kind yields finite values that the dtype represents (after the one rounding the
    strategy applies), with the kind's defining feature."""
    fi = torch.finfo(dtype)
    rng = np.random.default_rng(0)
    for _ in range(20):
        vals = S._block_values(kind, rng, 64, dtype, float(fi.max), float(fi.tiny))
        t = torch.from_numpy(vals).to(dtype)
        assert bool(torch.isfinite(t).all()), (kind, vals)
        a = t.to(torch.float32).abs()
        if kind == "zeros":
            assert not bool(a.any()) and not bool(torch.signbit(t).any())
        elif kind == "subnormal":
            # exact: no rounding happened, and below the dtype's (or fp16's) smallest normal
            assert torch.equal(t.to(torch.float64), torch.from_numpy(vals))
            assert bool((a > 0).all() and (a < 2.0**-14).all())
        elif kind == "huge":
            assert float(a.max()) >= 65504.0 * (0.5 if dtype == torch.float16 else 1)
        elif kind == "tiny":
            assert bool((a > 0).all()) and float(a.max()) < (1e-3 if dtype == torch.float16
                                                            else 1e-28)
        elif kind == "constant":
            assert bool((t == t[0]).all())
        elif kind == "ties":
            assert torch.equal(t.to(torch.float64), torch.from_numpy(vals))
        elif kind == "outlier":
            srt = a.sort(descending=True).values
            assert float(srt[0]) >= 20 * float(srt[1])


def test_subnormals_of_all_dtypes_in_fp32() -> None:
    """fp32 subnormal blocks hold fp32 subnormals and fp16 subnormals (normal in fp32)."""
    vals = S._block_values("subnormal", np.random.default_rng(1), 4096, torch.float32,
                           float(torch.finfo(torch.float32).max), 1.17e-38)
    a = np.abs(vals)
    assert (a < 1.1754944e-38).any() and ((a > 1e-30) & (a < 2.0**-14)).any()


@pytest.mark.parametrize(("pred", "what"), [
    (lambda x: bool(torch.signbit(x[x == 0]).any()), "negative zero"),
    (lambda x: x.dtype == torch.float32 and bool((x.abs() == torch.finfo(x.dtype).max).any()),
     "fp32 max"),
    (lambda x: x.dtype == torch.float16 and bool((x.abs() == 65504).any()), "fp16 max"),
    (lambda x: x.dtype == torch.bfloat16 and bool(((x != 0) & (x.abs() < 1.2e-38)).any()),
     "bf16 subnormal"),
    (lambda x: bool(((x.abs() > 9e29) & (x.abs() < 1.1e31)).any()), "1e30"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_find_adversarial(pred, what: str) -> None:
    find(adversarial_tensors(lengths(32, 4), block_size=32), pred, settings=FIND)


def test_nonfinite_only_when_allowed() -> None:
    find(adversarial_tensors(64, block_size=32, allow_nonfinite=True),
         lambda x: bool(torch.isnan(x).any()), settings=FIND)
    find(adversarial_tensors(64, block_size=32, allow_nonfinite=True),
         lambda x: bool(torch.isinf(x).any()), settings=FIND)


def test_kinds_argument() -> None:
    with pytest.raises(ValueError, match="kinds"):
        adversarial_tensors(4, kinds=("nan",))
    with pytest.raises(ValueError, match="kinds"):
        adversarial_tensors(4, kinds=())

    @settings(max_examples=30)
    @given(x=adversarial_tensors(64, dtype=torch.float32, block_size=32, kinds=("zeros",)))
    def only_zeros(x: torch.Tensor) -> None:
        assert not bool(x.any())

    only_zeros()


@pytest.mark.parametrize("bs", [32, 128])
def test_lengths_edges(bs: int) -> None:
    for target in (0, 1, bs - 1, bs, bs + 1, 3 * bs):
        assert find(lengths(bs), lambda n, t=target: n == t, settings=FIND) == target

    @given(n=lengths(bs, max_blocks=3))
    def in_range(n: int) -> None:
        assert 0 <= n <= 3 * bs

    in_range()


@given(spec=quant_specs(), seed=seeds())
def test_specs_and_seeds_valid(spec: QuantSpec, seed: int) -> None:
    assert isinstance(spec, QuantSpec) and 0 <= seed < 2**64


def test_without_hypothesis_the_import_error_names_the_extra(monkeypatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # "import hypothesis" now fails
    monkeypatch.delitem(sys.modules, "qcomm.testing.strategies")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[test\]'"):
        importlib.import_module("qcomm.testing.strategies")
    # The codec property checks do not need it.
    monkeypatch.delitem(sys.modules, "qcomm.testing.properties", raising=False)
    importlib.import_module("qcomm.testing.properties")


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: adversarial_tensors(-1), ValueError, "n must be an int >= 0 or a strategy"),
    (lambda: adversarial_tensors(4, block_size=0), ValueError, "block_size must be an int >= 1"),
    (lambda: adversarial_tensors(4, allow_nonfinite="yes"), TypeError, "allow_nonfinite"),
    (lambda: lengths(0), ValueError, "block_size must be an int >= 1"),
    (lambda: lengths(32, -1), ValueError, "max_blocks must be an int >= 0"),
    (lambda: quant_specs(bits=()), ValueError, r"bits must be a non-empty subset"),
    (lambda: quant_specs(bits=(3,)), ValueError, r"bits must be a non-empty subset.*got \[3\]"),
    (lambda: quant_specs(rounding=("up",)), ValueError, "rounding must be a non-empty subset"),
    (lambda: quant_specs(block_size=100), ValueError, "block_size must be a power of two"),
])
def test_bad_arguments_are_named_when_the_strategy_is_made(make, error, match) -> None:
    """Refused where the strategy is made, naming the argument: an empty ``bits`` failed
    inside hypothesis at the first draw ("Cannot sample from a length-zero sequence"), a
    negative ``n`` in numpy, a ``block_size`` of 100 at every draw of a test."""
    with pytest.raises(error, match=match):
        make()
