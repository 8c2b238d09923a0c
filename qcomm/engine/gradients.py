"""The node's gradient mean and the agreement on non-finite gradients.

Before the local update every rank of a node must hold the same gradients (the node's mean), and
when a gradient holds NaN or Inf every rank that must act together has to make the same choice:
raise, or skip the step. Who must agree:

* the ranks of a node: they hold one copy of the model between them;
* with ``on_nonfinite="skip"`` and several nodes, the nodes too: a node that skips a step would
  not start the gossip round its peers wait for.

Order of operations (no state changes before the vote is in):

* full-precision mean (``intra_bits=None``): the mean itself is stateless and a NaN on any rank
  propagates into every rank's mean, so mean first, then each rank checks its own copy (they are
  bit-identical, so the node agrees without another message);
* quantized mean (``intra_bits``): the codec keeps error-feedback residuals and a call counter,
  and refuses non-finite input on one rank only. So the node votes first (one 1-element
  all-reduce), then the nodes vote when skipping is agreed across them, and only a step every
  rank will take runs the quantized mean;
* the rail vote (skip mode, several nodes): one 1-element all-reduce over the rail.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.topology import Topology

__all__ = ["NonFiniteGradientError", "all_finite", "node_mean_and_vote"]


class NonFiniteGradientError(FloatingPointError):
    """A (node-averaged) gradient holds NaN or Inf; the step changed nothing.

    Attributes:
        params: ``(group index, parameter index in the group)`` of each offending parameter
            (empty when another rank or node reported it).
    """

    def __init__(self, message: str, params: list[tuple[int, int]]):
        super().__init__(message)
        self.params = params


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no tensor holds NaN or +-Inf. One host sync per device, whatever the number of
    tensors (tensors may live on several devices)."""
    # Not a sum-based test: the sum of finite values can overflow to Inf (a false alarm).
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


def _flag(finite: bool, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: 1.0 when this rank saw a non-finite gradient; on the gradients' device (a
    NCCL-only group cannot reduce CPU tensors)."""
    device = grads[0].device if grads else torch.device("cpu")
    return torch.tensor([0.0 if finite else 1.0], device=device)


def _vote(finite: bool, grads: Sequence[torch.Tensor], group: object, link: str,
          timeout_s: float | None) -> bool:
    """True when every member of ``group`` saw finite gradients."""
    flag = _flag(finite, grads)
    all_reduce(flag, group, "max", timeout_s=timeout_s, link=link,
               operation="vote on finite gradients")
    return flag.item() == 0.0


def node_mean_and_vote(grads: Sequence[torch.Tensor], topology: Topology,
                       intra: IntraNodeAllreduce | None, *, grads_are_node_means: bool,
                       quantized: bool, skip_across_nodes: bool,
                       timeout_s: float | None = None) -> tuple[bool, bool]:
    """Replace ``grads`` by the node's mean (unless they are already) and agree on finiteness.

    Args:
        grads: this rank's gradients, the same shapes on every rank of the node.
        topology: the job's layout (its intra and rail groups are used).
        intra: the node's allreduce, None when alone on the node.
        grads_are_node_means: True when DDP over the node's group averaged them in backward.
        quantized: the intra-node mean goes through the codec (``intra_bits``).
        skip_across_nodes: ``on_nonfinite="skip"`` with several nodes: the nodes vote too.
        timeout_s: how long each collective waits for the other ranks.

    Returns:
        ``(go, locally_finite)``: ``go`` is True when every rank that must agree saw finite
        gradients (the step goes ahead); ``locally_finite`` says whether this node's own
        gradients were finite (for the error message).
    """
    if intra is not None and not quantized and not grads_are_node_means:
        intra.mean_(grads)
    finite = all_finite(grads)
    if intra is not None and quantized and not grads_are_node_means:
        finite = _vote(finite, grads, topology.intra_group, "intra", timeout_s)
    node_finite = finite
    if skip_across_nodes:
        finite = _vote(finite, grads, topology.rail_group, "inter", timeout_s)
    if finite and intra is not None and quantized and not grads_are_node_means:
        intra.mean_(grads)
    return finite, node_finite
