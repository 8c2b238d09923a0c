"""ASSGD: the hierarchical asynchronous optimizer (intra-node synchronous gradient averaging,
inter-node asynchronous compressed gossip), and per-rank checkpoints.

    from qcomm.sgd import ASSGD, save_checkpoint, load_checkpoint

    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9, bits=4, procs_per_node=8)
"""

from qcomm.sgd.assgd import ASSGD, NonFiniteGradientError
from qcomm.sgd.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

__all__ = ["ASSGD", "NonFiniteGradientError", "checkpoint_path", "load_checkpoint",
           "save_checkpoint"]
