"""What a checkpoint saves of an optimizer, stated below the optimizers themselves: the base
every optimizer on the averaging engine derives from (:class:`qcomm.sgd.HierarchicalOptimizer`,
ASSGD included), and the key its state dict holds the engine's state under. The checkpoints
check and read an optimizer through these, so that this package imports nothing of
:mod:`qcomm.sgd` (which re-exports the checkpoints' functions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from qcomm.engine import AveragingEngine

__all__ = ["STATE_KEY", "CheckpointableOptimizer"]

# The entry of an optimizer's state_dict() that holds its engine's state.
STATE_KEY = "qcomm"


class CheckpointableOptimizer:
    """The base of the optimizers the checkpoints save: a ``torch.optim.Optimizer`` whose
    communication is ``engine`` and which wraps ``optimizer``; its ``state_dict()`` holds the
    engine's state under :data:`STATE_KEY`. It declares what the checkpoints use and holds
    nothing (no attribute, no method): :class:`qcomm.sgd.HierarchicalOptimizer` derives from
    it and torch's ``Optimizer``."""

    engine: AveragingEngine
    optimizer: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
