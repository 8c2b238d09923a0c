"""The averaging engine: one model's communication across nodes, under any optimizer.

Layering: :mod:`qcomm.collectives` (topology, allreduce, gossip) -> :mod:`qcomm.engine` (what
one model sends, when, and its state) -> :mod:`qcomm.sgd` (the torch.optim surface).

- :class:`AveragingEngine`: intra-node gradient mean, inter-node gossip of the parameters,
  exact averaging, stats, state_dict, close.
- :class:`CommOptions`: the validated communication options every optimizer accepts.
- :class:`~qcomm.engine.gradients.NonFiniteGradientError` (exported by :mod:`qcomm.sgd`): a
  NaN/Inf gradient stopped a step that changed nothing.
- :class:`~qcomm.engine.sharded.ShardedParamsError` (exported by :mod:`qcomm.sgd`): DTensor
  parameters (or an option with them) that qcomm cannot communicate.
"""

from qcomm.engine.engine import AveragingEngine
from qcomm.engine.options import CommOptions
from qcomm.engine.sharded import ShardedParamsError

__all__ = ["AveragingEngine", "CommOptions", "ShardedParamsError"]
