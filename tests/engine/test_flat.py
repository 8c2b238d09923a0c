"""The flat parameter buffer: float32 parameters live in it (views), others are copied."""

from __future__ import annotations

import torch

from qcomm.engine.flat import FlatParams


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
            for shape in [(3, 4), (5,), (2, 2, 2)]]


def test_float32_parameters_become_views_of_the_buffer_and_keep_their_values() -> None:
    params = _params()
    ids = [id(p) for p in params]
    values = [p.detach().clone() for p in params]
    flat = FlatParams(params, num_shards=2, align=8)
    assert flat.aliased
    assert [id(p) for p in params] == ids
    for p, v in zip(params, values, strict=True):
        assert torch.equal(p, v)
    # A write to the buffer is a write to the parameters, and back.
    flat.flat.add_(1.0)
    assert torch.equal(params[1], values[1] + 1.0)
    with torch.no_grad():
        params[0].mul_(0)
    assert torch.equal(flat.flat[:12], torch.zeros(12))
    # The padding stays zero and outside every parameter.
    assert flat.padded_numel == 32 and flat.numel == 25


def test_an_optimizer_steps_aliased_parameters_in_place() -> None:
    params = _params()
    flat = FlatParams(params, num_shards=1, align=8)
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    before = flat.flat.clone()
    opt.step()
    assert not torch.equal(flat.flat[: flat.numel], before[: flat.numel])
    assert torch.equal(flat.flat[: params[0].numel()], params[0].detach().reshape(-1))


def test_other_dtypes_are_copied_in_and_out() -> None:
    params = _params(torch.bfloat16)
    flat = FlatParams(params, num_shards=2, align=8)
    assert not flat.aliased
    flat.load_from_params()
    flat.flat.mul_(2)
    assert not torch.equal(params[0].float() * 2, params[0].float())  # untouched until stored
    flat.store_to_params(keep=[False, True, False])
    assert torch.equal(params[0], (flat.flat[:12].view(3, 4)).to(torch.bfloat16))
    assert params[1].dtype == torch.bfloat16


def test_replaced_data_is_taken_back_into_the_buffer() -> None:
    params = _params()
    flat = FlatParams(params, num_shards=1, align=8)
    fresh = torch.full((5,), 7.0)
    params[1].data = fresh            # e.g. a load_state_dict(assign=True)
    flat.check_aliased()
    assert flat.aliased
    assert params[1].data_ptr() != fresh.data_ptr()
    assert torch.equal(flat.flat[12:17], fresh)


def test_snapshot_and_restore_undo_a_round_on_kept_parameters() -> None:
    params = _params()
    flat = FlatParams(params, num_shards=1, align=8)
    kept = params[2].detach().clone()
    saved = flat.snapshot([False, False, True])
    flat.flat.add_(3.0)               # what a round's mixing does
    flat.restore(saved)
    assert torch.equal(params[2], kept)
    assert not torch.equal(params[0], params[0] - 3.0)


def test_parameters_sharing_storage_are_copied_not_pulled_apart() -> None:
    a = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(a.data[:2])     # tied by hand: a view of a's storage
    flat = FlatParams([a, b], num_shards=1, align=8)
    assert not flat.aliased
    with torch.no_grad():
        a[0, 0] = 5.0
    assert b[0, 0] == 5.0                  # still tied
