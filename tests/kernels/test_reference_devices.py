"""The reference codec gives the same bytes on every device.

The reference is the CPU path and the oracle, and it also runs on CUDA tensors (the codec's
``reference`` backend there, and the kernel benchmark's oracle for sizes too large to copy to
the CPU). torch's CUDA kernels are not all correctly rounded the way the CPU's are: ``x / c``
with a Python float ``c`` is computed as ``x * fl(1 / c)``, one ulp off ``fl(x / c)`` for some
``x``. The 4- and 8-bit scales ``absmax / L`` once went through that path, and the reference on
an H200 disagreed with itself on the CPU (and with the Triton kernels) in about one 8-bit scale
in 200 and many more 4-bit ones.

On a machine without a GPU the ``device`` fixture is the CPU and the cross-device comparison is
one of the CPU with itself; ``test_scales_are_correctly_rounded_quotients`` holds the property
on any device against an independent float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qcomm.kernels import reference
from qcomm.kernels.wire_format import QuantSpec, packed_nbytes

SEED = 2**40 + 7


def _oracle_scales(absmax: np.ndarray, levels: int) -> np.ndarray:
    """float32 scales of the wire format from float32 ``absmax``: the quotient correctly rounded
    (a float64 quotient of two float32 values rounds to float32 without double-rounding error),
    one ulp up where ``scale * L < absmax`` in float32, one down where ``scale * L`` overflows."""
    a = absmax.astype(np.float32)
    lev = np.float32(levels)
    with np.errstate(over="ignore"):
        s = (a.astype(np.float64) / levels).astype(np.float32)
        s = np.where(s * lev < a, np.nextafter(s, np.float32(np.inf)), s)
        s = np.where(np.isinf(s * lev) & np.isfinite(a), np.nextafter(s, np.float32(0)), s)
    return s.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_scales_are_correctly_rounded_quotients(bits: int, device: str) -> None:
    """Block scales on ``device`` equal the float64 oracle's for 20,000 absmax values spanning
    the float32 range, among them values where multiplying by the rounded reciprocal gives a
    different float32 than dividing (checked, so the test covers the case it is about)."""
    spec = QuantSpec(bits, 32, "nearest")
    levels = spec.max_level
    g = torch.Generator().manual_seed(bits)
    mant = 1 + torch.rand(20_000, generator=g, dtype=torch.float64)
    expo = torch.randint(-140, 127, (20_000,), generator=g).to(torch.float64)
    absmax = (mant * 2.0**expo).to(torch.float32)
    absmax[:3] = torch.tensor([torch.finfo(torch.float32).max, 0.0, 1e-45])
    inv = torch.tensor(1.0 / levels, dtype=torch.float32)
    by_reciprocal = absmax * inv
    quotient = torch.div(absmax, torch.full_like(absmax, float(levels)))
    assert int((by_reciprocal != quotient).sum()) > 100, "no input exercises the rounding"

    blocks = torch.zeros(absmax.numel(), spec.block_size)
    blocks[:, 5] = -absmax  # the block's absmax sits anywhere, with either sign
    got = reference.block_scales(blocks.to(device), blocks.numel(), spec).cpu()
    want = torch.from_numpy(_oracle_scales(absmax.numpy(), levels))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reference_bytes_are_the_same_on_every_device(bits: int, rounding: str,
                                                      device: str) -> None:
    """quantize (payload and residual) and weighted dequant_accumulate on ``device`` give the
    CPU's bytes, over 1,024 blocks of normal values and a few outliers."""
    spec = QuantSpec(bits, 128, rounding)
    n = 1024 * spec.block_size - 3
    g = torch.Generator().manual_seed(bits * 10 + len(rounding))
    x = torch.randn(n, generator=g)
    x[::1001] *= 1e4
    error = torch.randn(n, generator=g) * 0.01
    nbytes = packed_nbytes(n, spec)
    payload_cpu = torch.empty(nbytes, dtype=torch.uint8)
    err_cpu = torch.empty(n)
    reference.quantize_into(x, spec, payload_cpu, error, err_cpu, SEED)
    payload_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    err_dev = torch.empty(n, device=device)
    reference.quantize_into(x.to(device), spec, payload_dev, error.to(device), err_dev, SEED)
    assert torch.equal(payload_dev.cpu(), payload_cpu)
    assert torch.equal(err_dev.cpu().view(torch.int32), err_cpu.view(torch.int32))

    # A second real payload (not shifted bytes of the first: those make NaN scales, whose bit
    # patterns the CPU and CUDA produce differently and the wire format leaves open).
    second = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_into(torch.randn(n, generator=g) * 3, spec, second, None, None, SEED + 1)
    payloads = torch.stack([payload_cpu, second])
    weights = torch.tensor([0.3, 1.7])
    out_cpu = torch.randn(n, generator=g)
    out_dev = out_cpu.to(device, copy=True)
    reference.dequant_accumulate_into(payloads, spec, out_cpu, weights)
    reference.dequant_accumulate_into(payloads.to(device), spec, out_dev, weights.to(device))
    assert torch.equal(out_dev.cpu().view(torch.int32), out_cpu.view(torch.int32))
