"""The checkpoints' public names: qcomm.checkpoint exports them, qcomm.sgd (where they were
first) re-exports the very same objects, and the optimizers they save derive from the base the
checkpoints check for."""

from __future__ import annotations

import qcomm.checkpoint
import qcomm.sgd
from qcomm.checkpoint.optimizer import STATE_KEY, CheckpointableOptimizer
from qcomm.sgd.hierarchical_optimizer import STATE_KEY as SGD_STATE_KEY


def test_qcomm_sgd_re_exports_the_checkpoints_names() -> None:
    for name in qcomm.checkpoint.__all__:
        assert name in qcomm.sgd.__all__, name
        assert getattr(qcomm.sgd, name) is getattr(qcomm.checkpoint, name), name


def test_the_optimizers_are_checkpointable() -> None:
    assert issubclass(qcomm.sgd.HierarchicalOptimizer, CheckpointableOptimizer)
    assert issubclass(qcomm.sgd.ASSGD, CheckpointableOptimizer)
    assert SGD_STATE_KEY == STATE_KEY == "qcomm"
