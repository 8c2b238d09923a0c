"""The torch.optim surface of qcomm: optimizers on the averaging engine, and per-rank
checkpoints.

    from qcomm.sgd import ASSGD, HierarchicalOptimizer, save_checkpoint, load_checkpoint

    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, bits=4, procs_per_node=8)
    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), bits=4)
"""

from qcomm.engine.gradients import NonFiniteGradientError
from qcomm.engine.sharded import ShardedParamsError
from qcomm.sgd.assgd import ASSGD
from qcomm.sgd.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from qcomm.sgd.checkpoint_file import CheckpointError, UnsafeCheckpointError
from qcomm.sgd.hierarchical_optimizer import HierarchicalOptimizer
from qcomm.sgd.settings import ADAMW_SLOW_LINK, SLOW_LINK
from qcomm.sgd.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = ["ADAMW_SLOW_LINK", "ASSGD", "SLOW_LINK", "CheckpointError", "HierarchicalOptimizer",
           "NonFiniteGradientError", "ShardedParamsError", "UnsafeCheckpointError",
           "checkpoint_path", "load_checkpoint", "load_sharded_checkpoint", "save_checkpoint",
           "save_sharded_checkpoint"]
