"""Checkpoints of an optimizer on the averaging engine (:class:`qcomm.sgd.HierarchicalOptimizer`,
ASSGD included), its model and torch's RNG state, so that a resumed run continues bit for bit.

    from qcomm.checkpoint import save_checkpoint, load_checkpoint

- :mod:`.checkpoint`: :func:`save_checkpoint` / :func:`load_checkpoint`, one file per rank (each
  rank writes and reads its own; no collective), and :func:`checkpoint_path`.
- :mod:`.checkpoint_file`: a rank's file on disk, its metadata record, and reading both safely
  (:class:`CheckpointError`, :class:`UnsafeCheckpointError`).
- :mod:`.sharded_checkpoint`: :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`,
  one torch.distributed.checkpoint (DCP) directory for a model sharded by FSDP2.
- :mod:`.weights_only_planner`: the DCP load planner that unpickles through torch's weights-only
  unpickler (imported at the first sharded load: DCP brings DTensor with it).
- :mod:`.tensor_tree`: a state of nested containers as tensors only, and back (what DCP holds
  without pickles).
- :mod:`.optimizer`: what a checkpoint saves of an optimizer (the base it derives from).

:mod:`qcomm.sgd` re-exports the functions and errors (``from qcomm.sgd import save_checkpoint``).
"""

from qcomm.checkpoint.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from qcomm.checkpoint.checkpoint_file import CheckpointError, UnsafeCheckpointError
from qcomm.checkpoint.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = ["CheckpointError", "UnsafeCheckpointError", "checkpoint_path", "load_checkpoint",
           "load_sharded_checkpoint", "save_checkpoint", "save_sharded_checkpoint"]
