"""The reference codec codes big tensors in chunks of ``reference.CHUNK`` elements; chunking
must not change a single bit. Here CHUNK is shrunk to a few blocks so that small tensors cross
many chunk boundaries, and every output is compared bit for bit with one whole-tensor pass
(whose bytes tests/kernels/test_triton_parity.py and test_reference_golden.py hold)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcomm.kernels import reference
from qcomm.kernels.wire_format import QuantSpec, packed_nbytes

WHOLE = 1 << 30  # one chunk for every size used here


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (every NaN made the same NaN: non-finite blocks' residuals are NaN)."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _values(n: int, seed: int, nonfinite: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g)
    x[torch.rand(n, generator=g) < 0.05] = -0.0
    if nonfinite and n:
        x[int(torch.randint(0, n, (), generator=g))] = float("nan")
    return x


def _quantize(x, spec, error_mode, seed):
    n = x.numel()
    payload = torch.full((packed_nbytes(n, spec),), 0xA5, dtype=torch.uint8)
    e_in = torch.linspace(-1e-3, 1e-3, n) if error_mode != "none" else None
    e_out = None
    if error_mode == "out":
        e_out = torch.full((n,), 7.0)
    elif error_mode == "alias":
        e_out = e_in
    reference.quantize_into(x, spec, payload, e_in, e_out, seed)
    return payload, e_out


@settings(max_examples=60)
@given(bits=st.sampled_from([1, 2, 4, 8]), block=st.sampled_from([32, 64, 256]),
       rounding=st.sampled_from(["nearest", "stochastic"]), chunk_blocks=st.integers(1, 4),
       n=st.integers(0, 2000), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       error_mode=st.sampled_from(["none", "in", "out", "alias"]), nonfinite=st.booleans(),
       seed=st.integers(0, 2**64 - 1))
def test_chunks_change_nothing(bits, block, rounding, chunk_blocks, n, dtype, error_mode,
                               nonfinite, seed):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _check_chunks(QuantSpec(bits, block, rounding), chunk_blocks, n, dtype, error_mode,
                      nonfinite, seed, monkeypatch)


def _check_chunks(spec, chunk_blocks, n, dtype, error_mode, nonfinite, seed, monkeypatch):
    block = spec.block_size
    x = _values(n, seed % 2**31, nonfinite).to(dtype)
    monkeypatch.setattr(reference, "CHUNK", WHOLE)
    want = _quantize(x, spec, error_mode, seed)
    monkeypatch.setattr(reference, "CHUNK", chunk_blocks * block)
    got = _quantize(x, spec, error_mode, seed)
    assert torch.equal(got[0], want[0])
    if want[1] is not None:
        assert torch.equal(_bits(got[1]), _bits(want[1]))

    # decoding, of finite payloads (a NaN scale is refused before the reference is called)
    monkeypatch.setattr(reference, "CHUNK", WHOLE)
    payloads = torch.stack([_quantize(_values(n, s, False), spec, "none", s)[0]
                            for s in range(3)])
    weights = torch.tensor([0.5, -1 / 3, 3.0])
    outs = {}
    for chunk in (WHOLE, chunk_blocks * block):
        monkeypatch.setattr(reference, "CHUNK", chunk)
        d = torch.empty(n, dtype=dtype)
        reference.dequantize_into(payloads[0], spec, d)
        acc = torch.linspace(-1.0, 1.0, n)
        reference.dequant_accumulate_into(payloads, spec, acc, weights)
        outs[chunk] = (d, acc)
    for a, b in zip(outs[WHOLE], outs[chunk_blocks * block], strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_default_chunk_is_whole_blocks(bits, monkeypatch):
    """CHUNK is a multiple of every block size, so chunks never split a block; a tensor of two
    default chunks codes as one."""
    assert reference.CHUNK % 4096 == 0
    spec = QuantSpec(bits, 4096, "stochastic")
    n = reference.CHUNK + 4096 + 3  # two chunks, the second with a partial block
    x = _values(n, 0, False)
    got = _quantize(x, spec, "out", 9)
    monkeypatch.setattr(reference, "CHUNK", WHOLE)
    want = _quantize(x, spec, "out", 9)
    assert torch.equal(got[0], want[0]) and torch.equal(_bits(got[1]), _bits(want[1]))
