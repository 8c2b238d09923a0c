"""all_finite: exactly the tensors without NaN or +-Inf, whatever the dtype, shape or device."""

from __future__ import annotations

import pytest
import torch

from qcomm.engine.gradients import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 17, -1])
def test_any_single_bad_value_is_found(dtype: torch.dtype, bad: float, where: int) -> None:
    tensors = [torch.randn(5, 7).to(dtype), torch.randn(33).to(dtype), torch.empty(0, dtype=dtype)]
    assert all_finite(tensors)
    tensors[1].view(-1)[where] = bad
    assert not all_finite(tensors)


def test_large_finite_values_are_finite_and_empty_lists_too() -> None:
    # A sum of these overflows float32; they are finite all the same.
    big = torch.full((1000,), 3e38)
    assert all_finite([big, -big]) and all_finite([]) and all_finite([torch.empty(0)])
