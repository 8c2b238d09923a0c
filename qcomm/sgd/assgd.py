"""ASSGD: hierarchical asynchronous SGD, i.e. ``torch.optim.SGD`` on qcomm's averaging engine.

One step on every rank (``L`` ranks per node, ``n`` nodes):

1. gradients -> synchronous mean over the node's ranks (full precision by default);
2. the local update, ``torch.optim.SGD``'s own (momentum, dampening, nesterov, weight decay,
   maximize, foreach, fused), so all ranks of a node hold the same parameters afterwards;
3. with ``n > 1``: the parameters are flattened to float32 and split into ``L`` shards; local rank
   ``l`` runs one round of asynchronous CHOCO gossip on shard ``l`` with the ranks of local rank
   ``l`` on the other nodes (its *rail*, so every NIC of a node carries 1/L of the traffic), then
   the node all-gathers the shards.

Without torch.distributed (or with world size 1) steps 1 and 3 vanish and ASSGD is bit-identical
to ``torch.optim.SGD``; with one node step 3 vanishes and it is synchronous data-parallel SGD.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from qcomm.collectives.topology import Topology
from qcomm.engine.options import CommOptions
from qcomm.sgd.hierarchical_optimizer import HierarchicalOptimizer
from qcomm.sgd.options import check_sgd_group

__all__ = ["ASSGD"]


class ASSGD(HierarchicalOptimizer):
    """Hierarchical asynchronous SGD with compressed gossip between nodes (a torch Optimizer):
    ``HierarchicalOptimizer(torch.optim.SGD(...), ...)`` with SGD's arguments.

    Args:
        params: iterable of parameters (floating or complex, any shapes), named parameters,
            or param-group dicts (each group may set its own lr, momentum, dampening,
            weight_decay, nesterov, maximize, foreach, differentiable, fused).
        lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, fused: exactly as
            in ``torch.optim.SGD`` (``lr`` and ``weight_decay`` may be 1-element tensors;
            ``dampening`` must lie in [0, 1]). ``fused=True`` where SGD cannot fuse raises
            SGD's own RuntimeError (with several processes, at the first step, before the
            gradients are averaged).
        differentiable: as in ``torch.optim.SGD`` in a single process (the step is SGD's
            alone). With peers it raises ValueError: the node's gradient mean and the gossip
            are not differentiable.
        layout: the job's :class:`~qcomm.collectives.Topology` (None: built at the first
            distributed step).
        comm, **comm_options: the communication options, a
            :class:`~qcomm.engine.CommOptions` and/or its fields as keywords (see
            :class:`~qcomm.sgd.HierarchicalOptimizer`).

    Limits of "drop-in" (see :class:`~qcomm.sgd.HierarchicalOptimizer` for the whole list):
    gradients must be dense (a sparse gradient raises TypeError, in one process too); the
    parameters that require a gradient at the first distributed step are the ones
    communicated (unfreezing one later raises); ``add_param_group`` is refused after that
    step; ``differentiable=True`` needs a single process. A hyperparameter SGD checks itself
    (a negative lr, momentum or weight_decay, an lr tensor of several elements, nesterov
    without momentum or with dampening) raises SGD's own error, word for word, in added and
    loaded param groups too; what SGD lets through (a wrong kind, NaN or +Inf, dampening
    outside [0, 1]) raises ValueError/TypeError in qcomm's wording
    (``"<name> must be <what>, got <value>"``).
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 momentum: float = 0, dampening: float = 0,
                 weight_decay: float | torch.Tensor = 0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 layout: Topology | None = None, comm: CommOptions | None = None,
                 **comm_options: Any) -> None:
        hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, maximize=maximize, foreach=foreach,
                     differentiable=differentiable, fused=fused)
        check_sgd_group(hyper)
        sgd = torch.optim.SGD(params, **hyper)
        for group in sgd.param_groups:
            check_sgd_group(group)
        super().__init__(sgd, layout=layout, comm=comm, **comm_options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.SGD.add_param_group``, validating the group's hyperparameters first.
        Not allowed after the first distributed step."""
        check_sgd_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def _check_groups(self, state_dict: dict[str, Any]) -> None:
        for group in state_dict.get("param_groups", []):
            check_sgd_group({**self.defaults, **group})
