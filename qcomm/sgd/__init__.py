"""The torch.optim surface of qcomm: optimizers on the averaging engine, the settings the README
recommends (``SLOW_LINK``, ``ADAMW_SLOW_LINK``), and the checkpoints' functions and errors
(from :mod:`qcomm.checkpoint`, where they live).

    from qcomm.sgd import ASSGD, HierarchicalOptimizer, save_checkpoint, load_checkpoint

    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, bits=4, procs_per_node=8)
    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), bits=4)
"""

# The checkpoints live in qcomm.checkpoint; their names stay importable from here.
from qcomm.checkpoint import (
    CheckpointError,
    UnsafeCheckpointError,
    checkpoint_path,
    load_checkpoint,
    load_sharded_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from qcomm.engine.gradients import NonFiniteGradientError
from qcomm.engine.sharded import ShardedParamsError
from qcomm.sgd.assgd import ASSGD
from qcomm.sgd.hierarchical_optimizer import HierarchicalOptimizer
from qcomm.sgd.monitor import log_stats, stats_scalars
from qcomm.sgd.settings import ADAMW_SLOW_LINK, SLOW_LINK

__all__ = ["ADAMW_SLOW_LINK", "ASSGD", "SLOW_LINK", "CheckpointError", "HierarchicalOptimizer",
           "NonFiniteGradientError", "ShardedParamsError", "UnsafeCheckpointError",
           "checkpoint_path", "load_checkpoint", "load_sharded_checkpoint", "log_stats",
           "save_checkpoint", "save_sharded_checkpoint", "stats_scalars"]
