"""Refuse a qcomm optimizer that a Lightning strategy other than ``QcommStrategy`` steps.

Under Lightning's own ``strategy="ddp"`` the model is wrapped in DDP over every rank: every
gradient then crosses the slow link in fp32 beside qcomm's gossip (nothing is saved), and no
rank averages its parameters before it evaluates or saves. It runs, silently wrong; this check
makes it an error at the first step, naming the strategy to use. It imports no framework: it
recognises Lightning by the closure Lightning's precision plugins pass to ``step()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WrongStrategyError", "check_lightning_strategy"]

# Set on an optimizer by QcommStrategy when it takes the optimizer over.
OWNED_FLAG = "_qcomm_lightning_strategy"

_LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")


class WrongStrategyError(RuntimeError):
    """A qcomm optimizer with peers is stepped by Lightning under a strategy that is not
    ``qcomm.integrations.lightning.QcommStrategy``."""


def stepped_by_lightning(closure: Any) -> bool:
    """Whether ``closure`` is the one Lightning's precision plugins pass to ``optimizer.step``
    (a ``functools.partial`` of their ``_wrap_closure``), in automatic and manual optimization
    alike."""
    func = getattr(closure, "func", None)
    module = getattr(func, "__module__", None) or ""
    return module.startswith(_LIGHTNING_MODULES)


def check_lightning_strategy(closure: Any, optimizer: Any) -> None:
    """Raise :class:`WrongStrategyError` when Lightning steps ``optimizer`` (a qcomm optimizer
    with peers) and ``QcommStrategy`` did not take it over. Changes nothing."""
    if stepped_by_lightning(closure) and not getattr(optimizer, OWNED_FLAG, False):
        raise WrongStrategyError(
            f"{type(optimizer).__name__} is stepped by Lightning under a strategy that is not "
            "qcomm's: Lightning's DDP strategies average every gradient over every rank in "
            "fp32 across the slow link, beside qcomm's gossip. Use "
            "Trainer(strategy=qcomm.integrations.lightning.QcommStrategy(**SLOW_LINK)) and "
            "return the plain torch optimizer from configure_optimizers (the strategy wraps "
            "it).")
