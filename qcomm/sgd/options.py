"""Validation of torch.optim.SGD's hyperparameters for ASSGD (ValueError/TypeError naming the
argument). The communication options live in :mod:`qcomm.engine.options`."""

from __future__ import annotations

import torch

from qcomm.engine.options import CommOptions
from qcomm.validation import check_instance, check_real

__all__ = ["CommOptions", "check_nonneg", "check_sgd_group"]


def check_nonneg(name: str, value: object) -> None:
    """A finite float >= 0 (or, for lr, a 1-element tensor holding one)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float >= 0 or a 1-element tensor, "
                             f"got a tensor of {value.numel()} elements")
        value = float(value.item())
    check_real(name, value, low=0)


def check_sgd_group(group: dict) -> None:
    """Validate the torch.optim.SGD hyperparameters of one param group."""
    for name in ("lr", "momentum", "weight_decay"):
        check_nonneg(name, group[name])
    dampening = check_real("dampening", group["dampening"], low=0, high=1)
    check_instance("nesterov", group["nesterov"], bool, what="a bool")
    if group["nesterov"] and (group["momentum"] <= 0 or dampening != 0):
        raise ValueError(
            "nesterov=True requires momentum > 0 and dampening = 0, got "
            f"momentum={group['momentum']!r}, dampening={group['dampening']!r}"
        )
    check_instance("maximize", group["maximize"], bool, what="a bool")
    check_instance("foreach", group["foreach"], bool, allow_none=True, what="a bool")
    # Groups saved by torch versions before these flags lack them; SGD then takes its default.
    check_instance("differentiable", group.get("differentiable", False), bool, what="a bool")
    check_instance("fused", group.get("fused"), bool, allow_none=True, what="a bool")
