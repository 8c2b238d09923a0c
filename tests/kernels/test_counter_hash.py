"""The torch counter hash (int32 arithmetic standing in for uint32) against an independent
numpy uint32 implementation of the definition in qcomm.kernels.counter_hash's docstring."""

import numpy as np
import pytest
import torch

from qcomm.kernels.counter_hash import stream_key, uniform


def _mix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def _uniform_np(seed: int, start: int, count: int) -> np.ndarray:
    idx = np.arange(start, start + count, dtype=np.uint64)
    lo = (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    keys = np.array([stream_key(seed, int(h)) for h in (idx >> np.uint64(32))], dtype=np.uint32)
    with np.errstate(over="ignore"):
        h = _mix32_np(_mix32_np(lo ^ keys) + keys)
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


@pytest.mark.parametrize(("seed", "start", "count"), [
    (0, 0, 5000),
    (7, 2**31 - 2500, 5000),           # crosses the int32 sign boundary of the low word
    (2**64 - 1, 2**32 - 2500, 5000),   # crosses a 2**32 boundary: two stream keys
    (123456789, 3 * 2**32 + 17, 4096),
    (2**40 + 5, 0, 0),
])
def test_uniform_matches_numpy_uint32(seed: int, start: int, count: int) -> None:
    got = uniform(seed, start, count)
    want = torch.from_numpy(_uniform_np(seed, start, count))
    assert got.dtype == torch.float32 and got.shape == (count,)
    assert torch.equal(got, want)


def test_uniform_is_in_unit_interval_and_roughly_uniform() -> None:
    """Mean of 2**20 draws within 5 sigma of 1/2 (false failure ~ 6e-7)."""
    u = uniform(42, 0, 1 << 20).double()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    sigma = (1 / 12 / u.numel()) ** 0.5
    assert abs(float(u.mean()) - 0.5) < 5 * sigma
