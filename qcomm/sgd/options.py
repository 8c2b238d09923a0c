"""Validation of torch.optim.SGD's hyperparameters for ASSGD (ValueError/TypeError naming the
argument). The communication options live in :mod:`qcomm.engine.options`."""

from __future__ import annotations

import math

import torch

from qcomm.engine.options import CommOptions, is_real

__all__ = ["CommOptions", "check_nonneg", "check_sgd_group"]


def check_nonneg(name: str, value: object) -> None:
    """A finite real >= 0 (or, for lr, a 1-element tensor holding one)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float >= 0 or a 1-element tensor, "
                             f"got a tensor of {value.numel()} elements")
        value = float(value.item())
    if not is_real(value):
        raise TypeError(f"{name} must be a float >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


def check_sgd_group(group: dict) -> None:
    """Validate the torch.optim.SGD hyperparameters of one param group."""
    for name in ("lr", "momentum", "weight_decay"):
        check_nonneg(name, group[name])
    dampening = group["dampening"]
    if not is_real(dampening) or not 0 <= dampening <= 1:
        raise ValueError(f"dampening must be a float in [0, 1], got {dampening!r}")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
    if group["nesterov"] and (group["momentum"] <= 0 or dampening != 0):
        raise ValueError(
            "nesterov=True requires momentum > 0 and dampening = 0, got "
            f"momentum={group['momentum']!r}, dampening={dampening!r}"
        )
    if not isinstance(group["maximize"], bool):
        raise TypeError(f"maximize must be a bool, got {group['maximize']!r}")
    if group["foreach"] not in (None, True, False):
        raise TypeError(f"foreach must be None or a bool, got {group['foreach']!r}")
