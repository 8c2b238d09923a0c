"""What the engine is attached to: the optimizer's parameters (read from its param groups at every
use) and the model whose buffers follow them (:meth:`~Attachment.attach`), or which DDP wraps
inside the node (:meth:`~Attachment.data_parallel`).

The communicated parameters are those of the optimizer that require a gradient at the first
distributed step; the attached model's buffers are compared across ranks then, so both must
be attached before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import TorchWorld
from qcomm.engine.buffers import ModelBuffers
from qcomm.engine.options import CommOptions
from qcomm.engine.placement import Placement
from qcomm.engine.sharded import ShardedParamsError

__all__ = ["Attachment", "check_fused_devices"]

log = logging.getLogger("qcomm")


def check_fused_devices(groups: list[dict[str, Any]]) -> None:
    """torch's own RuntimeError for ``fused=True`` on parameters its fused kernels refuse
    (device or dtype), raised here, before the gradients are averaged, instead of inside the
    wrapped optimizer's step, after. (torch's check is private; without it, the wrapped
    optimizer's step raises the same error later.)"""
    check = getattr(torch_optimizer, "_device_dtype_check_for_fused", None)
    if check is None:
        return
    for group in groups:
        if group.get("fused"):
            for p in group["params"]:
                check(p)


class Attachment:
    """The optimizer ``owner`` whose ``param_groups`` hold the parameters, the attached model's
    buffers (None until :meth:`attach`) and whether DDP averages the gradients inside the node
    (``ddp_intra``, set by :meth:`data_parallel`)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.buffers: ModelBuffers | None = None
        self.ddp_intra = False

    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, each once, in param-group order."""
        seen: set[int] = set()
        out = []
        for group in self.owner.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def locate(self, param: torch.Tensor) -> tuple[int, int]:
        """``(group index, index in the group)`` of ``param``."""
        for gi, group in enumerate(self.owner.param_groups):
            for pi, p in enumerate(group["params"]):
                if p is param:
                    return gi, pi
        raise KeyError("parameter not in the optimizer")

    def attach(self, model: torch.nn.Module, *, kept_by_ddp: bool, ready: bool) -> None:
        """Register ``model``'s buffers (``ready``: the first distributed step ran, too late).

        Raises:
            ValueError: none of ``model``'s parameters is the optimizer's.
            RuntimeError: ``ready``.
        """
        buffers = ModelBuffers(model, kept_by_ddp=kept_by_ddp)
        mine = {id(p) for p in self.params()}
        if mine and any(True for _ in model.parameters()) and not any(
                id(p) in mine for p in model.parameters()):
            raise ValueError("model: none of its parameters is this optimizer's; attach the "
                             "model whose parameters the optimizer was built on")
        if ready:
            raise RuntimeError("attach() must be called before the first step: every rank's "
                               "buffers are compared when the process groups are made")
        self.buffers = buffers

    def data_parallel(self, model: torch.nn.Module, options: CommOptions, placement: Placement,
                      *, ready: bool, setup: Callable[[], Topology],
                      **ddp_kwargs: Any) -> torch.nn.Module:
        """``model`` in ``DistributedDataParallel`` over this node's ranks (``setup``: builds
        the groups, collective, and returns the topology), or ``model`` itself alone on the
        node or without peers; attached in every case
        (:meth:`qcomm.engine.AveragingEngine.data_parallel` says what it raises)."""
        if options.intra_bits is not None:
            raise ValueError("data_parallel() averages gradients in full precision with DDP; "
                             "it cannot be combined with intra_bits (set intra_bits=None)")
        if ready:
            raise RuntimeError("data_parallel() must be called before the first step")
        if placement.sharding(self.owner.param_groups):
            raise ShardedParamsError(
                "data_parallel() with sharded parameters: FSDP2 already averages the gradients "
                "inside the node; call attach(model) for its buffers instead")
        if not placement.distributed:   # (at the depth of the engine's own calls: its warning)
            self.attach(model, kept_by_ddp=False, ready=False)
            return model
        world = placement.given.world if placement.given is not None else None
        if world is not None and not isinstance(world, TorchWorld):
            raise TypeError(f"data_parallel() needs torch.distributed process groups, not the "
                            f"groups of {world!r}")
        topo = placement.topology()
        if topo.procs_per_node == 1:
            self.attach(model, kept_by_ddp=False, ready=False)
            if topo.rank == 0:
                log.info("qcomm: data_parallel() returns the model as it is: one rank per "
                         "node, so there is nothing to average inside a node")
            return model
        from torch.nn.parallel import DistributedDataParallel

        self.attach(model, kept_by_ddp=ddp_kwargs.get("broadcast_buffers", True), ready=False)
        # Before the groups are made: the agreement check compares it across ranks.
        self.ddp_intra = True
        return DistributedDataParallel(model, process_group=setup().intra_group, **ddp_kwargs)
