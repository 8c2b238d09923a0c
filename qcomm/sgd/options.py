"""Validation of torch.optim.SGD's hyperparameters for ASSGD (ValueError/TypeError naming the
argument). The communication options live in :mod:`qcomm.engine.options`."""

from __future__ import annotations

import numbers

import torch

from qcomm.engine.options import CommOptions
from qcomm.validation import check_instance, check_real, fail

__all__ = ["CommOptions", "check_nonneg", "check_sgd_group"]

# The hyperparameters SGD compares with 0; each may be a real number or a 1-element tensor.
_NONNEG = ("lr", "momentum", "weight_decay")


def check_nonneg(name: str, value: object) -> None:
    """A finite float >= 0 (or, for lr, a 1-element tensor holding one)."""
    if isinstance(value, torch.Tensor):
        _check_one_element(name, value)
        value = float(value.item())
    check_real(name, value, low=0)


def _check_one_element(name: str, value: torch.Tensor) -> None:
    """ValueError unless ``value`` holds one element (a hyperparameter is one number)."""
    if value.numel() != 1:
        raise ValueError(f"{name} must be a float >= 0 or a 1-element tensor, "
                         f"got a tensor of {value.numel()} elements")


def check_sgd_group(group: dict) -> None:
    """Validate the torch.optim.SGD hyperparameters of one param group.

    Three passes, in this order: the kinds (qcomm's TypeErrors, where SGD would fail inside a
    comparison), SGD's own checks in SGD's own words (a drop-in raises what the optimizer it
    replaces raises, for the same mistake), then what SGD lets through (NaN, +Inf, a dampening
    outside [0, 1]) in qcomm's words.
    """
    _check_kinds(group)
    _check_as_sgd(group)
    _check_limits(group)


def _check_kinds(group: dict) -> None:
    """TypeError (ValueError for a tensor of several elements) for a value of the wrong kind."""
    for name in _NONNEG:
        value = group[name]
        if isinstance(value, torch.Tensor):
            # SGD checks the size of lr itself (next pass); the others it compares with 0,
            # which a tensor of several elements cannot answer.
            if name != "lr":
                _check_one_element(name, value)
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            fail(name, "a finite float >= 0 or a 1-element tensor", value, TypeError)
    dampening = group["dampening"]
    if isinstance(dampening, bool) or not isinstance(dampening, numbers.Real):
        fail("dampening", "a float in [0, 1]", dampening, TypeError)
    check_instance("nesterov", group["nesterov"], bool, what="a bool")
    check_instance("maximize", group["maximize"], bool, what="a bool")
    check_instance("foreach", group["foreach"], bool, allow_none=True, what="a bool")
    # Groups saved by torch versions before these flags lack them; SGD then takes its default.
    check_instance("differentiable", group.get("differentiable", False), bool, what="a bool")
    check_instance("fused", group.get("fused"), bool, allow_none=True, what="a bool")


def _check_as_sgd(group: dict) -> None:
    """``torch.optim.SGD.__init__``'s checks, with its exception types and messages word for
    word (torch 2.13; tests/sgd/test_drop_in.py compares them with SGD's own), in its order.
    Run on added and loaded groups too, which SGD does not check: one sentence per mistake."""
    lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if group["nesterov"] and (momentum <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def _check_limits(group: dict) -> None:
    """What SGD accepts but cannot train with: NaN or +Inf, a dampening outside [0, 1]."""
    for name in _NONNEG:
        check_nonneg(name, group[name])
    check_real("dampening", group["dampening"], low=0, high=1)
