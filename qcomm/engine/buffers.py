"""The attached model's buffers (BatchNorm's running statistics and batch counters): the same on
the ranks of a node after every step, and on every rank after the exact average.

The optimizer steps the parameters and the gossip mixes them; the buffers are written by the
forward pass, on each rank from its own batches. Which buffers, and the rules (docs/engine.md,
"Buffers", has the measurement behind the third):

* the model's persistent buffers (those ``state_dict()`` holds), each once: floating and complex
  ones (a complex one as its two floats per value) are averaged; integer ones (e.g.
  ``num_batches_tracked``) take the maximum; bool ones are left as they are;
* inside a node, after every step (and every skipped one): floating buffers <- their mean over
  the node's ranks, integer ones <- their maximum (one small all-reduce each, over the fast
  link), unless DDP (``data_parallel()``, ``broadcast_buffers=True``) keeps them in step itself;
* between nodes, during training: each node keeps its own statistics until the next
  ``average_parameters()``;
* ``average_parameters()``: floating buffers <- their exact mean over every rank of the live
  nodes, integer ones <- their maximum, the same bits on every rank.

Sums run in float64: a buffer that is the same on every rank (a constant) keeps its exact bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcomm.collectives.group import CommGroup
from qcomm.collectives.primitives import all_reduce
from qcomm.engine.gradients import real_view
from qcomm.validation import check_instance

__all__ = ["ModelBuffers", "NodesReduce"]

# ``(vector, op)`` -> (the vector reduced over the live nodes, their count); ``op``: "sum" or
# "max"; the vector is the same on every rank of the node, and so is the result.
NodesReduce = Callable[[torch.Tensor, str], tuple[torch.Tensor, int]]


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer ``model.state_dict()`` holds, each tensor once."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


class ModelBuffers:
    """The buffers of ``model`` that communication keeps in agreement (module docstring).

    Args:
        model: the model the optimizer's parameters belong to.
        kept_by_ddp: DDP broadcasts them inside the node at every forward, so the node's
            per-step mean is not needed.
    """

    def __init__(self, model: torch.nn.Module, *, kept_by_ddp: bool = False) -> None:
        check_instance("model", model, torch.nn.Module, what="a torch.nn.Module")
        named = _persistent_buffers(model)
        self.floating = [(n, b) for n, b in named if b.is_floating_point() or b.is_complex()]
        self.integer = [(n, b) for n, b in named
                        if not (b.is_floating_point() or b.is_complex()) and b.dtype != torch.bool]
        self.kept_by_ddp = kept_by_ddp

    def __len__(self) -> int:
        return len(self.floating) + len(self.integer)

    def signature(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Name, shape and dtype of every buffer kept in agreement: every rank must have the
        same (the engine's agreement check compares them)."""
        return [(n, tuple(b.shape), b.dtype) for n, b in (*self.floating, *self.integer)]

    def values(self) -> dict[str, torch.Tensor]:
        """Every buffer kept in agreement, by name: CPU copies (what a node that joins the
        running job starts from)."""
        return {n: b.detach().to("cpu", copy=True) for n, b in (*self.floating, *self.integer)}

    @torch.no_grad()
    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Every buffer <- ``values[name]`` (a :meth:`values` of the same model).

        Raises:
            ValueError: a name, shape or dtype differs (named); nothing is changed.
        """
        mine = dict((*self.floating, *self.integer))
        for n, b in mine.items():
            v = values.get(n)
            if v is None or v.shape != b.shape or v.dtype != b.dtype:
                got = None if v is None else (tuple(v.shape), v.dtype)
                raise ValueError(f"buffer {n!r} is {(tuple(b.shape), b.dtype)} here and "
                                 f"{got} in the state given: not the same model")
        for n, b in mine.items():
            b.copy_(values[n])

    # -----------------------------------------------------------------------------------------

    @staticmethod
    def _gather(buffers: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
        device = buffers[0][1].device
        return torch.cat([real_view(b.detach()).reshape(-1).to(device, dtype)
                          for _, b in buffers])

    @staticmethod
    def _scatter(buffers: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        at = 0
        for _, b in buffers:
            target = real_view(b.detach())
            n = target.numel()
            target.copy_(flat[at:at + n].view(target.shape))
            at += n

    @torch.no_grad()
    def node_mean(self, group: CommGroup | None, procs_per_node: int, timeout_s: float) -> None:
        """Floating buffers <- their mean over the node's ranks, integer ones <- their maximum
        (collective over the node; nothing when alone on it or when DDP keeps them)."""
        if procs_per_node == 1 or self.kept_by_ddp or not len(self):
            return
        self._reduce(group, procs_per_node, timeout_s, nodes=None)

    @torch.no_grad()
    def average(self, group: CommGroup | None, procs_per_node: int, timeout_s: float,
                nodes: NodesReduce | None) -> None:
        """Floating buffers <- their exact mean over every rank of the live nodes, integer
        ones <- their maximum; the same bits everywhere (collective over the job). ``nodes``
        reduces a node's vector over the nodes (None: one node)."""
        if len(self):
            self._reduce(group, procs_per_node, timeout_s, nodes=nodes)

    def _reduce(self, group: CommGroup | None, procs_per_node: int, timeout_s: float,
                nodes: NodesReduce | None) -> None:
        for buffers, op, dtype in ((self.floating, "sum", torch.float64),
                                   (self.integer, "max", torch.int64)):
            if not buffers:
                continue
            flat = self._gather(buffers, dtype)
            if procs_per_node > 1:
                all_reduce(flat, group, op, timeout_s=timeout_s, link="intra",
                           operation="buffers' node mean")
            count = procs_per_node
            if nodes is not None:
                flat, live = nodes(flat, op)
                count *= live
            if op == "sum":
                flat.div_(count)
            self._scatter(buffers, flat)
