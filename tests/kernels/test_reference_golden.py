"""The reference codec's output for fixed inputs, pinned by digest: the wire format's bytes must
not move when the reference is rewritten for speed.

Digests of (payload, error_out, dequantize, weighted dequant_accumulate) per (bits, block size,
rounding). Bits 1, 4 and 8 were recorded with the version-1 reference and are unchanged in
version 2 of the wire format; the 2-bit ones are version 2's four-level code
(:data:`qcomm.kernels.wire_format.WIRE_FORMAT_VERSION`). The inputs span 60 decades, with zeros
of both signs, FLT_MAX in every block and a small residual; no NaN (its bit pattern is not part
of the format). The Triton kernels are held to the reference by tests/kernels/test_triton_parity.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from qcomm.kernels import reference
from qcomm.kernels.wire_format import WIRE_FORMAT_VERSION, QuantSpec, packed_nbytes

SEED = 2**63 + 12345
DIGESTS = {
    (1, 32, "nearest"): "a3c3812a1d96e706",
    (1, 32, "stochastic"): "a3c3812a1d96e706",
    (1, 128, "nearest"): "4108b0a897b471d1",
    (1, 128, "stochastic"): "4108b0a897b471d1",
    (1, 1024, "nearest"): "987eab9f26a6df57",
    (1, 1024, "stochastic"): "987eab9f26a6df57",
    (2, 32, "nearest"): "35bf805f3352acf8",
    (2, 32, "stochastic"): "df120e49a4d0fadb",
    (2, 128, "nearest"): "55366928683d6924",
    (2, 128, "stochastic"): "c833ec172f66bc13",
    (2, 1024, "nearest"): "d42a61d1c0d97bc8",
    (2, 1024, "stochastic"): "5a5dd509a5d543d1",
    (4, 32, "nearest"): "d2d5b84a018e6f91",
    (4, 32, "stochastic"): "303e48d63d4e4ae8",
    (4, 128, "nearest"): "723b53bab2aaeacc",
    (4, 128, "stochastic"): "a9787b3a9b93122d",
    (4, 1024, "nearest"): "7064c8f699083e86",
    (4, 1024, "stochastic"): "7064c8f699083e86",
    (8, 32, "nearest"): "1f8c38c1366512da",
    (8, 32, "stochastic"): "b3ba4b0f8774444e",
    (8, 128, "nearest"): "9deb890a31be1400",
    (8, 128, "stochastic"): "8507a73dc0ff8714",
    (8, 1024, "nearest"): "5c32fe727412a725",
    (8, 1024, "stochastic"): "5c32fe727412a725",
}


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n).to(torch.float32)
    kinds = torch.randint(0, 10, (n,), generator=g)
    x = torch.where(kinds == 0, x * 1e-12, x)
    x = torch.where(kinds == 1, torch.zeros(n), x)
    x = torch.where(kinds == 2, torch.full((n,), -0.0), x)
    x[::97] = torch.finfo(torch.float32).max
    return x, torch.randn(n, generator=g) * 1e-3


def _digest(spec: QuantSpec) -> str:
    n = 5000 + spec.block_size + 3
    x, e = _inputs(n, spec.bits * 100 + spec.block_size)
    payload = torch.empty(packed_nbytes(n, spec), dtype=torch.uint8)
    error_out = torch.empty(n)
    reference.quantize_into(x, spec, payload, e, error_out, SEED)
    decoded = torch.empty(n)
    reference.dequantize_into(payload, spec, decoded)
    acc = torch.randn(n, generator=torch.Generator().manual_seed(1))
    reference.dequant_accumulate_into(torch.stack([payload, payload]), spec, acc,
                                      torch.tensor([0.5, -1 / 3]))
    h = hashlib.sha256()
    for t in (payload, error_out, decoded, acc):
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def test_digests_are_for_this_wire_format_version() -> None:
    assert WIRE_FORMAT_VERSION == 2, "new format version: record new digests"


@pytest.mark.parametrize(("bits", "block_size", "rounding"), list(DIGESTS), ids=str)
def test_reference_bytes_unchanged(bits: int, block_size: int, rounding: str) -> None:
    assert _digest(QuantSpec(bits, block_size, rounding)) == DIGESTS[(bits, block_size, rounding)]
