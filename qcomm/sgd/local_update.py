"""The local step of ASSGD: exactly torch.optim.SGD's update, and the gradient finiteness check.

The update delegates to :func:`torch.optim.sgd.sgd`, torch's public functional SGD, with the
same arguments ``torch.optim.SGD.step`` passes it. That is the only way to stay bit-identical to
``torch.optim.SGD`` on every device and torch version: the for-loop, foreach and fused variants
differ in operation order (e.g. the foreach path computes ``grad + wd * p`` into a new list,
the for-loop path per tensor), and a re-implementation would have to track each of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.sgd import sgd as _torch_functional_sgd


def group_tensors(group: dict, state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                     list[torch.Tensor | None]]:
    """Params with a gradient, their gradients and momentum buffers (None before the first step),
    in the group's order: what ``torch.optim.SGD`` collects before its update."""
    params, grads, bufs = [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise TypeError("ASSGD does not support sparse gradients (a parameter has one)")
        params.append(p)
        grads.append(p.grad)
        if group["momentum"] != 0:
            bufs.append(state.get(p, {}).get("momentum_buffer"))
    return params, grads, bufs


def sgd_update_(group: dict, state: dict) -> None:
    """Apply one ``torch.optim.SGD`` step to the parameters of ``group`` that have gradients.

    Args:
        group: a param group with keys lr, momentum, dampening, weight_decay, nesterov,
            maximize, foreach.
        state: the optimizer's per-parameter state (``momentum_buffer`` entries are created and
            updated exactly as ``torch.optim.SGD`` does).
    """
    params, grads, bufs = group_tensors(group, state)
    if not params:
        return
    _torch_functional_sgd(
        params, grads, bufs,
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        has_sparse_grad=False,
        foreach=group["foreach"],
        fused=False,
    )
    if group["momentum"] != 0:
        for p, buf in zip(params, bufs, strict=True):
            state[p]["momentum_buffer"] = buf


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no tensor holds NaN or +-Inf. One host sync, whatever the number of tensors."""
    if not tensors:
        return True
    # Not a sum-based test: the sum of finite values can overflow to Inf (a false alarm).
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return bool(torch.stack(flags).all()) if flags else True
