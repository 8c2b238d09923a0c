"""One training step as the engine sees it, around the wrapped optimizer's update::

    sync_gradients()   # node mean of the gradients, finiteness (and this step's round) agreed
    optimizer.step()   # the wrapped optimizer's own update
    finish_step()      # the step clock advances; a gossip round when one is due
                       # (skip_step() instead when sync_gradients() voted to skip)

:class:`StepCycle` holds what lives between those calls (whether the gradients were averaged
for the step in progress, and the verdict) and the skipped steps' count; the step clock is the
run's (:class:`~qcomm.collectives.gossip.clock.StepClock`), advanced by the gossip when there is
one. At each step, a parameter without a gradient is left bit-identical, as torch's optimizers
leave it: the round still carries its values, but its correction is not written back into it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.member import GossipMember
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.topology import Topology
from qcomm.engine.attachment import Attachment
from qcomm.engine.gradients import (
    NonFiniteGradientError,
    all_finite,
    holds_values,
    node_mean_and_vote,
)
from qcomm.engine.options import CommOptions
from qcomm.engine.placement import Placement
from qcomm.engine.runtime import Runtime
from qcomm.engine.sharded import local_tensor

__all__ = ["StepCycle", "node_any"]


class StepCycle:
    """The calls around one step (module docstring).

    Args:
        options: the communication options.
        clock: the run's step clock (advanced here only while there is no gossip).
        lockstep: the gossip's nodes wait for each other's rounds (then a skipped step is
            skipped on every node: the nodes vote on it).
        attachment: the optimizer's parameters and the attached model's buffers.
        placement: where this rank runs (whether it has peers; a node that joins).
        skipped_steps: steps skipped so far.
    """

    def __init__(self, options: CommOptions, clock: StepClock, lockstep: bool,
                 attachment: Attachment, placement: Placement, skipped_steps: int = 0) -> None:
        self.options, self.clock, self.lockstep = options, clock, lockstep
        self.attachment, self.placement = attachment, placement
        self.skipped_steps = skipped_steps
        self.reset()

    def reset(self) -> None:
        """No step in progress: the next :meth:`sync` averages afresh."""
        self.synced = False   # sync ran for the step in progress
        self.go = True        # ... and its verdict

    def sync(self, runtime: Runtime | None, setup: Callable[[], Runtime]) -> bool:
        """:meth:`qcomm.engine.AveragingEngine.sync_gradients` (``runtime``: the one built,
        None before the first distributed step; ``setup``: builds it, collective)."""
        if self.synced:
            return self.go
        grads = self._communicated_grads()
        if not self.placement.distributed:
            # Alone, the step must cost what the wrapped optimizer's costs: gradients in host
            # memory are checked (reading them syncs no device), those on an accelerator only
            # when on_nonfinite="skip" asks for it (the skip needs the answer on the host).
            host_only = self.options.on_nonfinite != "skip"
            finite = node_finite = all_finite(grads, host_only=host_only)
        else:
            joining = runtime is None and self.placement.joining
            runtime = setup()
            if joining and runtime.node is not None:
                # This step's gradients are of the parameters the join just replaced.
                self.synced, self.go = True, False
                return False
            finite, node_finite = self._node_mean(runtime, grads)
        if not finite:
            self._nonfinite(node_finite)
        self.synced, self.go = True, finite
        return finite

    def _node_mean(self, rt: Runtime, grads: list[torch.Tensor]) -> tuple[bool, bool]:
        """The node's mean of ``grads`` and the votes (finiteness; the round this step
        applies, verified before anything of the step changes)."""
        self._check_frozen(rt.frozen)
        topo = rt.topology
        round_error, round_mask = None, None
        if rt.joins is not None:
            rt.joins.admit_new()
        if rt.node is not None and rt.node.round_due():
            # Before anything of this step changes: receive and verify the round this
            # step applies; the node agrees on it with the gradient mean (one collective).
            round_error = rt.node.prepare()
            round_mask = 1 << topo.local_rank if round_error is not None else 0
        finite, node_finite, failed = node_mean_and_vote(
            grads, topo, rt.intra, grads_are_node_means=self.attachment.ddp_intra or rt.sharded,
            grads_are_shards=rt.sharded, quantized=self.options.intra_spec is not None,
            # Nodes that do not wait for each other's rounds skip on their own.
            skip_across_nodes=(self.options.on_nonfinite == "skip" and topo.num_nodes > 1
                               and self.lockstep),
            timeout_s=self.options.timeout_s, round_mask=round_mask)
        if round_error is not None:
            raise round_error
        if failed:
            raise rt.node.node_mate_failed(failed)
        return finite, node_finite

    def _communicated_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.attachment.params():
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError("qcomm does not average sparse gradients (a parameter has one); "
                                "use a dense embedding or torch's DDP for that parameter")
            if not p.requires_grad:
                continue
            # A sharded parameter's gradient is this rank's part of the node's mean.
            grads.append(local_tensor(p.grad))
        return grads

    def _check_frozen(self, frozen: list[torch.Tensor]) -> None:
        for p in frozen:
            if p.grad is not None and p.requires_grad:
                gi, pi = self.attachment.locate(p)
                raise ValueError(
                    f"parameter (group {gi}, index {pi}) was frozen (requires_grad=False) at "
                    "the first distributed step and has a gradient now; the communicated "
                    "parameters are fixed at that step: unfreeze before the first step")

    def _nonfinite(self, node_finite: bool) -> None:
        """Raise, or count the skip."""
        if self.options.on_nonfinite == "skip":
            self.skipped_steps += 1
            return
        bad = []
        if not node_finite:
            for p in self.attachment.params():
                grad = None if p.grad is None else local_tensor(p.grad)
                if (grad is not None and holds_values(grad)
                        and not bool(torch.isfinite(grad).all())):
                    bad.append(self.attachment.locate(p))
        where = f"parameters (group, index) {bad[:8]}" if bad else "another rank's gradients"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) in {where}; parameters, optimizer state and "
            "communication state are unchanged (pass on_nonfinite='skip' to skip such steps)",
            bad,
        )

    def finish(self, runtime: Runtime | None) -> None:
        """:meth:`qcomm.engine.AveragingEngine.finish_step`."""
        self.synced = False
        if self.placement.distributed and runtime is not None and runtime.node is not None:
            node = runtime.node
            node.end_step([p.grad is None for p in node.params])
        else:
            self.clock.tick()
        self._buffers_node_mean(runtime)

    def skip(self, runtime: Runtime | None) -> None:
        """:meth:`qcomm.engine.AveragingEngine.skip_step`."""
        self.synced = False
        self._buffers_node_mean(runtime)

    def _buffers_node_mean(self, runtime: Runtime | None) -> None:
        """The attached model's buffers agree over the node's ranks (the forward wrote them
        from each rank's own batch)."""
        buffers = self.attachment.buffers
        if buffers is not None and runtime is not None:
            buffers.node_mean(runtime.topology.intra, runtime.topology.procs_per_node,
                              self.options.timeout_s)


def node_max(value: int, topology: Topology, timeout_s: float) -> int:
    """The largest ``value`` over this node's ranks (collective over the node's ranks: one
    1-element all-reduce on the fast link, nothing when alone on the node)."""
    if topology.procs_per_node == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=topology.control_device())
    all_reduce(t, topology.intra, "max", timeout_s=timeout_s, link="intra",
               operation="node_max")
    return int(t.item())


def job_progress(steps: int, gossip: GossipMember | None, topology: Topology,
                 timeout_s: float) -> int:
    """The job's progress in local steps as this node knows it, the same on every rank of the
    node (collective over the node's ranks, like :func:`node_any`): its own ``steps`` in
    lockstep; with ``wait_free`` the most of its own steps and what its neighbours' rounds
    show (the count the outer step anneals by, :meth:`GossipMember.progress`), so a node slower
    than the others can drive its learning-rate schedule by the job rather than by its own
    steps, and decay with the others."""
    own = gossip.progress() if gossip is not None else steps
    return node_max(max(own, steps), topology, timeout_s)


def node_any(flag: bool, topology: Topology, timeout_s: float) -> bool:
    """True when ``flag`` is True on any rank of this node (collective over the node's ranks:
    one 1-element all-reduce on the fast link, nothing when alone on the node)."""
    if topology.procs_per_node == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=topology.control_device())
    all_reduce(t, topology.intra, "max", timeout_s=timeout_s, link="intra",
               operation="node_any")
    return bool(t.item())

