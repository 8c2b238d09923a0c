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
* sharded parameters (FSDP2 made the mean in its reduce-scatter): each rank holds only its
  part of it, so the node votes (one 2-element all-reduce);
* the rail vote (skip mode, several nodes): one 1-element all-reduce over the rail.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from qcomm.collectives.group import CommGroup
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.topology import Topology

__all__ = ["HOST_DEVICE_TYPES", "NonFiniteGradientError", "all_finite", "holds_values",
           "host_readable", "node_mean_and_vote", "real_view"]


class NonFiniteGradientError(FloatingPointError):
    """A (node-averaged) gradient holds NaN or Inf; the step changed nothing.

    Attributes:
        params: ``(group index, parameter index in the group)`` of each offending parameter
            (empty when another rank or node reported it).
    """

    def __init__(self, message: str, params: list[tuple[int, int]]):
        super().__init__(message)
        self.params = params


# Device types whose memory the host reads directly: checking a gradient there costs no
# device synchronisation (a module attribute, so a test can pretend a device is not one).
HOST_DEVICE_TYPES: tuple[str, ...] = ("cpu",)


def holds_values(t: torch.Tensor) -> bool:
    """Whether ``t`` has values to read: not a meta tensor and not a fake one (both carry only
    shape, dtype and device; torch's optimizers step them without reading a value)."""
    return not t.is_meta and not isinstance(t, FakeTensor)


def host_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no device synchronisation: a plain tensor (no
    subclass: fake, distributed, ...) in host memory."""
    return t.device.type in HOST_DEVICE_TYPES and type(t) in (torch.Tensor, torch.nn.Parameter)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a complex tensor its real view (``torch.view_as_real``: one more
    trailing dimension of 2, the real and imaginary parts, sharing ``t``'s storage), so that
    what flattens, quantizes or reduces values sees a complex number as its two floats."""
    return torch.view_as_real(t) if t.is_complex() else t


def all_finite(tensors: Sequence[torch.Tensor], *, host_only: bool = False) -> bool:
    """True when no tensor holds NaN or +-Inf. One host read per device, whatever the number of
    tensors (tensors may live on several devices).

    Args:
        tensors: any shapes, floating or complex dtypes (a complex value is finite when both
            its parts are), on any devices. Tensors without values (meta, fake) count as
            finite: there is nothing to read.
        host_only: check only the tensors :func:`host_readable` (reading them costs no device
            synchronisation) and count the others as finite: what a single process does, so
            that its step adds no host sync to the wrapped optimizer's.
    """
    # Each tensor's min and max (one reduction pass, no temporary the size of the tensor;
    # NaN propagates into both, +-Inf shows in one): finite exactly when the tensor is. Not a
    # sum-based test: the sum of finite values can overflow to Inf (a false alarm).
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.numel() or not holds_values(t) or (host_only and not host_readable(t)):
            continue
        by_device.setdefault(t.device, []).extend(torch.aminmax(real_view(t)))
    return all(bool(torch.isfinite(torch.stack(ends)).all()) for ends in by_device.values())


def _flag(finite: bool, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [1]: 1.0 when this rank saw a non-finite gradient; on the gradients' device (a
    NCCL-only group cannot reduce CPU tensors)."""
    device = grads[0].device if grads else torch.device("cpu")
    return torch.tensor([0.0 if finite else 1.0], device=device)


def _vote(finite: bool, grads: Sequence[torch.Tensor], group: CommGroup | None, link: str,
          timeout_s: float | None, mask: int = 0) -> tuple[bool, int]:
    """``(every member of group saw finite gradients, OR of the members' masks)``: one
    2-element all-reduce (sum: the masks are distinct powers of two)."""
    device = grads[0].device if grads else torch.device("cpu")
    flags = torch.tensor([0 if finite else 1, mask], dtype=torch.int64, device=device)
    all_reduce(flags, group, "sum", timeout_s=timeout_s, link=link,
               operation="vote on finite gradients")
    bad, total = flags.tolist()
    return bad == 0, total


def node_mean_and_vote(grads: Sequence[torch.Tensor], topology: Topology,
                       intra: IntraNodeAllreduce | None, *, grads_are_node_means: bool,
                       quantized: bool, skip_across_nodes: bool,
                       timeout_s: float | None = None, round_mask: int | None = None,
                       grads_are_shards: bool = False) -> tuple[bool, bool, int]:
    """Replace ``grads`` by the node's mean (unless they are already) and agree on finiteness,
    and on the gossip round this step applies.

    Args:
        grads: this rank's gradients, the same shapes on every rank of the node; a complex
            gradient is averaged as its real view (its two floats per value).
        topology: the job's layout (its intra and rail groups are used).
        intra: the node's allreduce, None when alone on the node.
        grads_are_node_means: True when DDP over the node's group averaged them in backward.
        quantized: the intra-node mean goes through the codec (``intra_bits``).
        skip_across_nodes: ``on_nonfinite="skip"`` with several nodes: the nodes vote too.
        timeout_s: how long each collective waits for the other ranks.
        round_mask: when this step applies a gossip round, ``2**local_rank`` if this rank
            could not receive or verify it, else 0; None when no round is due. The node ORs
            the masks, riding on a collective the step runs anyway where there is one (the
            full-precision mean carries it as one more float), else in the vote.
        grads_are_shards: each rank holds only its part of the node's mean (FSDP2's
            reduce-scatter; pass ``grads_are_node_means`` too), so the node votes on
            finiteness: no rank sees the others' parts.

    Returns:
        ``(go, locally_finite, failed_mask)``: ``go`` is True when every rank that must agree
        saw finite gradients; ``locally_finite`` says whether this node's own gradients were
        finite (for the error message); ``failed_mask`` ORs the node's ``round_mask`` (0
        without a round or when alone on the node).
    """
    # Averaged in place through the real views, which share the complex gradients' storage.
    grads = [real_view(g) for g in grads]
    alone = intra is None
    mask = 0 if round_mask is None else round_mask
    failed = 0
    if not alone and not quantized and not grads_are_node_means:
        if round_mask is None:
            intra.mean_(grads)
        else:
            # One more element in the mean: sum / L of distinct powers of two, recovered
            # exactly (masks stay far below 2**24) by scaling back and rounding.
            device = grads[0].device if grads else torch.device("cpu")
            carrier = torch.tensor([float(mask)], dtype=torch.float32, device=device)
            intra.mean_([*grads, carrier])
            failed = round(carrier.item() * topology.procs_per_node)
    finite = all_finite(grads)
    node_votes = quantized or grads_are_shards
    if not alone and (node_votes or (grads_are_node_means and round_mask is not None)):
        voted_finite, failed = _vote(finite, grads, topology.intra, "intra", timeout_s,
                                     mask)
        # DDP's mean propagates NaN like ours: the finite verdict is the node's already.
        finite = voted_finite if node_votes else finite
    node_finite = finite
    if skip_across_nodes:
        finite, _ = _vote(finite, grads, topology.rail, "inter", timeout_s)
    if finite and not failed and not alone and quantized and not grads_are_node_means:
        intra.mean_(grads)
    return finite, node_finite, failed  # 0 when alone: only node-mates set it
