"""One model's communication across nodes: the layer between the collectives and the optimizers.

The optimizers (:mod:`qcomm.sgd`) own the update rule; the engine owns everything that crosses a
link. Per training step, around the wrapped optimizer's update::

    engine.sync_gradients()    # node mean of the gradients (full precision or intra_bits),
                               # finiteness agreed; False: skip this step everywhere
    optimizer.step()           # the local update, the wrapped optimizer's own code
    engine.finish_step()       # gossip of the parameters with the other nodes (CHOCO rounds)

and outside the loop :meth:`AveragingEngine.average_parameters` (exact global mean),
:meth:`~AveragingEngine.stats`, :meth:`~AveragingEngine.state_dict` and
:meth:`~AveragingEngine.close`.

What is communicated: the parameters of the optimizer that require a gradient when the first
distributed step runs (frozen ones never cross a link and never change). At each step, a
parameter without a gradient is left bit-identical, as torch's optimizers leave it: the gossip
round still carries its values (the layout is fixed), but the round's correction is not written
back into it.

Process groups are created lazily, at the first distributed step (collective: every rank must
reach it at the same point), never in a constructor. The groups come from the topology's
world (:class:`~qcomm.collectives.group.World`): torch.distributed's by default; a
:class:`~qcomm.collectives.topology.Topology` built over the in-memory world
(:mod:`qcomm.collectives.memory`) runs the whole engine with ranks as threads of one process,
the same code and the same bytes as over Gloo (tests, simulations).
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import optimizer as torch_optimizer

from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.factory import gossip_class
from qcomm.collectives.intra import IntraNodeAllreduce
from qcomm.collectives.linked_world import LinkedWorld
from qcomm.collectives.primitives import all_reduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.collectives.torch_group import TorchWorld
from qcomm.engine.agreement import check_agreement, check_job_agreement, fingerprint
from qcomm.engine.buffers import ModelBuffers
from qcomm.engine.gradients import (
    NonFiniteGradientError,
    all_finite,
    holds_values,
    node_mean_and_vote,
)
from qcomm.engine.joins import NodeJoins, check_linked_options
from qcomm.engine.node_gossip import NodeGossip
from qcomm.engine.options import CommOptions
from qcomm.engine.report import engine_stats, log_topology
from qcomm.engine.sharded import ShardedParamsError, check_sharding, local_tensor
from qcomm.engine.state import EngineStateFile, check_loadable, geometry
from qcomm.rendezvous.node import linked_seat
from qcomm.validation import check_instance

__all__ = ["AveragingEngine"]

log = logging.getLogger("qcomm")


def _check_not_differentiable(groups: list[dict[str, Any]]) -> None:
    """ValueError naming the first param group with ``differentiable=True``."""
    for gi, group in enumerate(groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"differentiable=True (param group {gi}) is supported in a single process "
                "only: the node's gradient mean and the gossip between nodes are not "
                "differentiable; pass differentiable=False")


def _check_fused_devices(groups: list[dict[str, Any]]) -> None:
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


class AveragingEngine:
    """Hierarchical averaging of one model: intra-node gradient mean, inter-node gossip.

    Args:
        owner: the optimizer whose ``param_groups`` hold the parameters (read at every use, so
            groups added before the first distributed step and a ``load_state_dict`` that
            replaces the group list are seen); each parameter is taken once, in group order.
        options: the communication options.
        topology: how the job's ranks map to nodes; None builds one from torch.distributed and
            torchrun's environment at the first distributed step. Pass one built over an in-memory
            world (:mod:`qcomm.collectives.memory`) to run in-process.

    The constructor communicates nothing and creates no process group.
    """

    def __init__(self, owner: Any, options: CommOptions, *,
                 topology: Topology | None = None) -> None:
        check_instance("options", options, CommOptions, what="a qcomm.engine.CommOptions")
        check_instance("topology", topology, Topology, allow_none=True,
                       what="a qcomm.collectives.Topology")
        self.options = options
        self.owner = owner
        # Nodes linked through the rendezvous (qcomm.rendezvous.init_node): the topology is the
        # seat's, its rails groups of two made as links open.
        self._linked = linked_seat() if topology is None else None
        if self._linked is not None:
            seat = self._linked
            topology = Topology(seat.procs_per_node, rank=seat.rank,
                                world_size=seat.world_size, world=LinkedWorld(seat))
        self._topology_arg = topology
        self.comm_stats = CommStats()
        self.clock = StepClock()   # the run's steps: the gossip advances it, or else finish_step
        self._kind = gossip_class(options.gossip_config())   # the gossip's mode, asked
        self.skipped_steps = 0
        self._reset_runtime()
        self._pending: dict[str, Any] | None = None  # loaded state waiting for the first step
        self._warned_env = False
        self._buffers: ModelBuffers | None = None   # the attached model's (attach())

    def _reset_runtime(self) -> None:
        """Forget everything that holds process groups or buffers (rebuilt lazily)."""
        self._ready = False
        self._topology: Topology | None = None
        self._intra: IntraNodeAllreduce | None = None
        self._node: NodeGossip | None = None   # the gossip between nodes, None on one node
        self._joins: NodeJoins | None = None   # joins on this rank's rail (linked nodes)
        self._frozen: list[torch.Tensor] = []
        self._grads_synced = False   # sync_gradients ran for the step in progress
        self._go = True              # ... and its verdict
        self._ddp_intra = False      # DDP over the node's group averages gradients in backward
        self._sharded = False        # FSDP2 shards the parameters over the node's ranks
        self._closed = False

    # -----------------------------------------------------------------------------------------
    # where are we

    @property
    def steps(self) -> int:
        """Steps applied: the run's clock (the gossip advances it when there is one, and says
        from it when a round is due)."""
        return self.clock.steps

    def _world_size_now(self) -> int | None:
        """The job's world size as known without a collective; None without a topology and
        without a process group."""
        if self._topology_arg is not None:
            return self._topology_arg.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return None

    @property
    def distributed(self) -> bool:
        """True when this rank has peers (a topology, or else a process group, of several
        ranks)."""
        world = self._world_size_now()
        if world is None:
            self._warn_env_without_group()
            return False
        return world > 1

    def check_groups(self, groups: list[dict[str, Any]]) -> None:
        """Raise ValueError when this rank has peers and a param group (``groups``: the
        optimizer's, or a state dict's) asks for ``differentiable=True``: the node's gradient
        mean and the gossip run outside autograd. Nothing to check in one process, where a
        step is the wrapped optimizer's alone. DTensor parameters, in ``groups`` or the
        optimizer's, are checked in any process (:meth:`sharding`)."""
        world = self._world_size_now()
        if world is not None and world > 1:
            _check_not_differentiable(groups)
        owned = self.owner.param_groups
        self.sharding([*owned, *(g for g in groups if not any(g is o for o in owned))])

    def sharding(self, groups: list[dict[str, Any]] | None = None,
                 topology: Topology | None = None) -> bool:
        """Whether the parameters of ``groups`` (None: the optimizer's) are FSDP2 shards of
        this node's ranks (no communication; see :mod:`qcomm.engine.sharded`).

        Raises:
            ShardedParamsError: DTensor parameters of any other kind, mixed with plain ones,
                or with an option that cannot work sharded.
        """
        return check_sharding(
            self.owner.param_groups if groups is None else groups, self.options,
            lambda: topology or self._topology_arg or Topology(self.options.procs_per_node))

    def _warn_env_without_group(self) -> None:
        if self._warned_env:
            return
        raw = os.environ.get("WORLD_SIZE", "")
        if raw.strip().isdigit() and int(raw) > 1:
            self._warned_env = True
            warnings.warn(
                f"WORLD_SIZE={raw} is set but torch.distributed is not initialized, so this "
                "process trains alone (no gradient averaging, no gossip). Call "
                "torch.distributed.init_process_group() before the first step.",
                RuntimeWarning, stacklevel=4,
            )

    @property
    def topology(self) -> Topology | None:
        """The job's topology once the first distributed step ran (or :meth:`setup` was called)."""
        return self._topology

    def geometry(self) -> tuple[int, int, int]:
        """(world size, ranks per node, rank) of this run, without any collective."""
        return geometry(self.options.procs_per_node, self._topology_arg)

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

    # -----------------------------------------------------------------------------------------
    # set-up (lazy: constructors must not run collectives)

    def setup(self) -> None:
        """Create the process groups and the communication objects (collective: every rank
        calls it at the same point; the first distributed step does). Idempotent."""
        if self._ready:
            return
        if self._closed:
            raise RuntimeError("the engine is closed")
        # Before any group is created: what the communication cannot carry out is refused
        # while nothing has changed.
        _check_not_differentiable(self.owner.param_groups)
        _check_fused_devices(self.owner.param_groups)
        opts = self.options
        if self._linked is not None:
            check_linked_options(opts, self._linked)
        topo = self._topology_arg or Topology(opts.procs_per_node)
        sharded = self.sharding(topology=topo)
        # Group creation is collective: every rank touches both properties here, in this order.
        _ = topo.intra_group
        _ = topo.rail_group
        intra = None
        if topo.procs_per_node > 1:
            intra = IntraNodeAllreduce(topo, bucket_mb=opts.bucket_mb, spec=opts.intra_spec,
                                       stats=self.comm_stats, seed=opts.seed,
                                       timeout_s=opts.timeout_s)
        params = self.params()
        communicated = [p for p in params if p.requires_grad]
        self._frozen = [p for p in params if not p.requires_grad]
        node = None
        if topo.num_nodes > 1 and communicated:
            node = NodeGossip(communicated, topo, intra, opts, self.comm_stats, self.clock,
                              sharded=sharded)
        # One small collective before anything is exchanged: every rank must have the same
        # options and the same communicated parameters, or all raise the same ValueError.
        buffers = self._buffers.signature() if self._buffers is not None else []
        row = fingerprint(opts, communicated, self._ddp_intra, buffers, sharded)
        if self._linked is None:
            check_agreement(row, topo.world_group, topo.world_size, topo.control_device(),
                            opts.timeout_s)
        else:
            self._joins = self._agree_and_join(row, topo, node)
        self._topology, self._intra, self._node = topo, intra, node
        self._sharded = sharded
        if self._pending is not None and self._linked is not None and self._linked.joining:
            # the node started from a running neighbour's state, not from its checkpoint's
            self._pending["gossip"] = None
        if self._pending is not None:
            if intra is not None and self._pending.get("intra") is not None:
                intra.load_state_dict(self._pending["intra"])
            if node is not None and self._pending.get("gossip") is not None:
                node.gossip.load_state_dict(self._pending["gossip"])
            self._pending = None
        self._ready = True
        log_topology(topo, self.options, self._ddp_intra, node.flat.numel if node else 0,
                     node.gossip.gamma if node else None, sharded=sharded)

    def _agree_and_join(self, row: list[int], topo: Topology,
                        node: NodeGossip | None) -> NodeJoins | None:
        """Linked nodes: agree over the node, then with the job at the rendezvous (a node that
        differs is refused alone); a node that comes back starts from a running neighbour's
        state; watch for the nodes that join after."""
        seat = self._linked
        check_agreement(row, topo.intra_group, topo.procs_per_node, topo.control_device(),
                        self.options.timeout_s)
        check_job_agreement(row, seat.store(), "qcomm/linked/agreement")
        if node is None:
            return None
        copies = self.options.join_optimizer_state == "copy" and not node.sharded
        joins = NodeJoins(seat, node, self._buffers, self.owner if copies else None)
        try:
            if seat.joining:
                joins.join()
            else:
                joins.start_without_absent()
            joins.watch()
        except BaseException:
            joins.close()
            raise
        return joins

    @property
    def _gossip(self) -> Any:
        """The gossip object (None without one)."""
        return self._node.gossip if self._node is not None else None

    @property
    def _flat(self) -> Any:
        """The flat parameters (None without gossip)."""
        return self._node.flat if self._node is not None else None

    def attach(self, model: torch.nn.Module, *, kept_by_ddp: bool = False) -> None:
        """Register ``model``'s buffers (BatchNorm's running statistics and counters): they
        then agree over the node's ranks after every step and over every rank after
        :meth:`average_parameters` (rules: :mod:`qcomm.engine.buffers`). Not collective.
        Before the first distributed step (the agreement check compares every rank's
        buffers then); attaching again replaces the model.

        Args:
            model: the module whose parameters this engine's optimizer holds.
            kept_by_ddp: DDP with ``broadcast_buffers=True`` keeps them in step inside the
                node (:meth:`data_parallel` says so).
        """
        buffers = ModelBuffers(model, kept_by_ddp=kept_by_ddp)
        mine = {id(p) for p in self.params()}
        if mine and any(True for _ in model.parameters()) and not any(
                id(p) in mine for p in model.parameters()):
            raise ValueError("model: none of its parameters is this optimizer's; attach the "
                             "model whose parameters the optimizer was built on")
        if self._ready:
            raise RuntimeError("attach() must be called before the first step: every rank's "
                               "buffers are compared when the process groups are made")
        self._buffers = buffers

    def data_parallel(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Wrap ``model`` in ``DistributedDataParallel`` over this node's ranks, so gradients
        are averaged inside the node during backward (bucketed, overlapped), and stop averaging
        them in :meth:`sync_gradients`. Collective (creates the process groups). Returns
        ``model`` itself when alone on the node or not distributed. Attaches ``model``
        (:meth:`attach`) in every case.

        Raises:
            ValueError: with ``intra_bits`` (DDP averages in full precision: choose one).
            TypeError: on a topology whose world is not torch.distributed's (DDP needs a
                process group).
        """
        if self.options.intra_bits is not None:
            raise ValueError("data_parallel() averages gradients in full precision with DDP; "
                             "it cannot be combined with intra_bits (set intra_bits=None)")
        if self._ready:
            raise RuntimeError("data_parallel() must be called before the first step")
        if self.sharding():
            raise ShardedParamsError(
                "data_parallel() with sharded parameters: FSDP2 already averages the gradients "
                "inside the node; call attach(model) for its buffers instead")
        if not self.distributed:
            self.attach(model)
            return model
        world = self._topology_arg.world if self._topology_arg is not None else None
        if world is not None and not isinstance(world, TorchWorld):
            raise TypeError(f"data_parallel() needs torch.distributed process groups, not the "
                            f"groups of {world!r}")
        topo = self._topology_arg or Topology(self.options.procs_per_node)
        if topo.procs_per_node == 1:
            self.attach(model)
            if topo.rank == 0:
                log.info("qcomm: data_parallel() returns the model as it is: one rank per "
                         "node, so there is nothing to average inside a node")
            return model
        from torch.nn.parallel import DistributedDataParallel

        self.attach(model, kept_by_ddp=ddp_kwargs.get("broadcast_buffers", True))
        # Before setup(): the agreement check compares it across ranks.
        self._ddp_intra = True
        self.setup()
        return DistributedDataParallel(model, process_group=self._topology.intra_group,
                                       **ddp_kwargs)

    # -----------------------------------------------------------------------------------------
    # one step

    def _communicated_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params():
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

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.grad is not None and p.requires_grad:
                gi, pi = self.locate(p)
                raise ValueError(
                    f"parameter (group {gi}, index {pi}) was frozen (requires_grad=False) at "
                    "the first distributed step and has a gradient now; the communicated "
                    "parameters are fixed at that step: unfreeze before the first step")

    def sync_gradients(self) -> bool:
        """Average the gradients over the node's ranks now and agree on finiteness.

        Call it right after backward when something between backward and ``step()`` needs
        the node's gradients (clipping, GradScaler's unscale); ``step()`` then does not average
        them again. Returns False when the step will be skipped (``on_nonfinite="skip"``).

        Raises:
            NonFiniteGradientError: a gradient holds NaN/Inf and ``on_nonfinite="raise"``;
                parameters, optimizer and communication state are unchanged.
            TypeError: a sparse gradient.
        """
        if self._grads_synced:
            return self._go
        grads = self._communicated_grads()
        if not self.distributed:
            # Alone, the step must cost what the wrapped optimizer's costs: gradients in host
            # memory are checked (reading them syncs no device), those on an accelerator only
            # when on_nonfinite="skip" asks for it (the skip needs the answer on the host).
            host_only = self.options.on_nonfinite != "skip"
            finite = node_finite = all_finite(grads, host_only=host_only)
        else:
            joining = not self._ready and self._linked is not None and self._linked.joining
            self.setup()
            if joining and self._node is not None:
                # This step's gradients are of the parameters the join just replaced.
                self._grads_synced, self._go = True, False
                return False
            self._check_frozen()
            topo = self._topology
            round_error, round_mask = None, None
            if self._joins is not None:
                self._joins.admit_new()
            if self._node is not None and self._node.round_due():
                # Before anything of this step changes: receive and verify the round this
                # step applies; the node agrees on it with the gradient mean (one collective).
                round_error = self._node.prepare()
                round_mask = 1 << topo.local_rank if round_error is not None else 0
            finite, node_finite, failed = node_mean_and_vote(
                grads, topo, self._intra, grads_are_node_means=self._ddp_intra or self._sharded,
                grads_are_shards=self._sharded,
                quantized=self.options.intra_spec is not None,
                # Wait-free nodes skip on their own: no peer waits for their rounds.
                skip_across_nodes=(self.options.on_nonfinite == "skip" and topo.num_nodes > 1
                                   and self._kind.lockstep),
                timeout_s=self.options.timeout_s, round_mask=round_mask)
            if round_error is not None:
                raise round_error
            if failed:
                raise self._node.node_mate_failed(failed)
        if not finite:
            self._nonfinite(node_finite)
        self._grads_synced, self._go = True, finite
        return finite

    def _nonfinite(self, node_finite: bool) -> None:
        """Raise, or count the skip."""
        if self.options.on_nonfinite == "skip":
            self.skipped_steps += 1
            return
        bad = []
        if not node_finite:
            for p in self.params():
                grad = None if p.grad is None else local_tensor(p.grad)
                if (grad is not None and holds_values(grad)
                        and not bool(torch.isfinite(grad).all())):
                    bad.append(self.locate(p))
        where = f"parameters (group, index) {bad[:8]}" if bad else "another rank's gradients"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) in {where}; parameters, optimizer state and "
            "communication state are unchanged (pass on_nonfinite='skip' to skip such steps)",
            bad,
        )

    def finish_step(self) -> None:
        """After the local update: when a round is due (every ``sync_every / fragments``
        steps), the gossip round of the next fragment of the communicated parameters (those
        without a gradient this step are left as they are)."""
        self._grads_synced = False
        if self.distributed and self._node is not None:
            self._node.end_step([p.grad is None for p in self._node.params])
        else:
            self.clock.tick()
        self._buffers_node_mean()

    def skip_step(self) -> None:
        """End a step that :meth:`sync_gradients` voted to skip."""
        self._grads_synced = False
        self._buffers_node_mean()

    def _buffers_node_mean(self) -> None:
        """The attached model's buffers agree over the node's ranks (the forward wrote them
        from each rank's own batch)."""
        if self._buffers is not None and self._topology is not None:
            self._buffers.node_mean(self._topology.intra_group,
                                    self._topology.procs_per_node, self.options.timeout_s)

    def discard_sync(self) -> None:
        """The gradients were dropped (``zero_grad``): the next :meth:`sync_gradients` averages
        afresh."""
        self._grads_synced = False

    def node_any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank of this node (collective over the node's
        ranks; one 1-element all-reduce on the fast link, nothing when alone on the node).

        With ``wait_free`` each node may run its own number of steps, but the ranks of one node
        must take the same steps (they hold one copy of the model): end a per-node time budget
        with ``if opt.node_any(time.monotonic() > deadline): break`` so that every rank of the
        node stops at the same step."""
        flag = bool(flag)
        if not self.distributed:
            return flag
        self.setup()
        topo = self._topology
        if topo.procs_per_node == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=topo.control_device())
        all_reduce(t, topo.intra_group, "max", timeout_s=self.options.timeout_s, link="intra",
                   operation="node_any")
        return bool(t.item())

    # -----------------------------------------------------------------------------------------
    # evaluation, statistics, shutdown

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Set every rank's communicated parameters to their exact global mean (collective).
        Completes the gossip rounds in flight first; all ranks end with the same bytes. The
        attached model's buffers (:meth:`attach`) too: floating ones to their exact mean,
        integer ones to their maximum; without an attached model buffers are not touched."""
        if not self.distributed:
            return
        self.setup()
        topo = self._topology
        if self._node is not None:
            self._node.average()
        # else: synchronous data parallel, the ranks hold the same parameters already
        if self._buffers is not None:
            nodes = None
            if self._node is not None:
                nodes = self._node.reduce_over_nodes
            elif topo.num_nodes > 1:   # nothing gossiped (every parameter frozen)
                nodes = self._rail_reduce
            self._buffers.average(topo.intra_group, topo.procs_per_node,
                                  self.options.timeout_s, nodes)

    def _rail_reduce(self, flat: torch.Tensor, op: str) -> tuple[torch.Tensor, int]:
        """``flat`` reduced over this rank's rail (every node, no gossip to ask for the live
        ones)."""
        topo = self._topology
        all_reduce(flat, topo.rail_group, op, timeout_s=self.options.timeout_s, link="inter",
                   operation="average_parameters")
        return flat, topo.num_nodes

    def stats(self, *, consensus: bool = False) -> dict[str, Any]:
        """What this rank sent and how the gossip is doing.

        Args:
            consensus: also compute the consensus distance (a collective over the rail: every
                rank must call ``stats(consensus=True)`` at the same point).

        Returns:
            dict with ``steps`` (applied), ``skipped_steps``, ``bytes_sent`` and
            ``messages_sent`` (``{"intra": int, "inter": int}``), ``staleness`` (rounds a gossip
            round stays in flight), ``gossip_rounds`` (started), ``fragment_rounds`` (rounds
            started per fragment, a list of ``fragments`` ints), ``gamma`` (the gossip's
            consensus step, None without gossip) and ``consensus_distance`` (``sqrt(mean_i
            ||x_i - mean x||^2)`` over nodes, float, or None when not asked for or with one
            node). With ``wait_free`` also ``rounds_received`` and
            ``lag_rounds``: per neighbour on this rank's rail (its global rank), the rounds of
            it applied here and how many rounds this rank has started beyond them; and
            ``terms_paired``: ``{"paired": n, "possible": m}``, the neighbour terms this rank's
            rounds added, against one per live neighbour per round (a copy not changed since
            it served its share of terms is left out: docs/engine.md, "Wait-free gossip");
            ``mix_lag_rounds``: ``{s: rounds}``, how many of this rank's rounds mixed the
            fragment of the round s before them (``staleness`` when every neighbour's message
            of that round had come in time; more, the older the information mixed).
        """
        out = engine_stats(self.steps, self.skipped_steps, self.comm_stats, self._gossip,
                           self._kind, self.options)
        if consensus and self._node is not None:
            out["consensus_distance"] = self._node.consensus_distance()
        return out

    def flush(self) -> None:
        """Wait for the gossip rounds in flight and apply them to the public copies (parameters
        are not touched; collective over the rail: every rank at the same step). After it, every
        byte :meth:`stats` counted has been delivered."""
        if self._gossip is not None:
            self._gossip.flush()

    def close(self) -> None:
        """Complete the gossip rounds in flight (when the peers still answer) and release the
        transport and every process-group reference. Never raises a peer's failure: after a
        :class:`~qcomm.collectives.errors.PeerError` it only releases. Idempotent."""
        if self._node is not None:
            # Each mode ends its own way (the lockstep one completes its rounds in flight when
            # the peers still answer; a wait-free drain would wait for peers that may be gone,
            # so it says goodbye instead).
            self._gossip.leave()
        if self._joins is not None:
            self._joins.close()
        self._reset_runtime()
        self._closed = True
        # Works and groups can sit in reference cycles (a round and its transport); collect
        # them now, before the caller destroys the process group, not at interpreter exit,
        # when Gloo aborts on pending works.
        gc.collect()

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's communication state: geometry, counters, gossip and intra-node codec
        state (references), the options. See :mod:`qcomm.engine.state`. With ``wait_free`` it
        drains the gossip first, a collective over the rail: every rank saves at the same
        point (as :func:`qcomm.sgd.save_checkpoint` does)."""
        gossip = self._node.state() if self._node is not None else (
            self._pending or {}).get("gossip")
        intra = self._intra.state_dict() if self._intra is not None else (
            self._pending or {}).get("intra")
        return EngineStateFile.build(
            geometry(self.options.procs_per_node, self._topology_arg),
            steps=self.steps, skipped_steps=self.skipped_steps, options=self.options,
            gossip=gossip, intra=intra, comm_stats=self.comm_stats.snapshot())

    def load_state_dict(self, state: dict[str, Any], *,
                        on_world_size_change: str = "error") -> None:
        """Load :meth:`state_dict` output (format 1 of qcomm 0.1.0 too). Validates first:
        nothing changes when it raises. See :func:`qcomm.engine.state.check_loadable`."""
        keep = check_loadable(state, self.options, self._topology_arg,
                              on_world_size_change=on_world_size_change)
        steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if "comm_stats" in state:
            self.comm_stats.load(state["comm_stats"])
        gossip_state = state["gossip"] if keep else None
        intra_state = state["intra"] if keep else None
        if self._node is not None and gossip_state is not None:
            self._node.gossip.load_state_dict(gossip_state)   # its clock with it
            gossip_state = None
        else:
            # without a gossip state (one node, the gossip not built yet, or a fresh one after
            # on_world_size_change="reinit") the clock goes on counting from here
            self.clock.restart(steps)
        if self._intra is not None and intra_state is not None:
            self._intra.load_state_dict(intra_state)
            intra_state = None
        self._pending = {"gossip": gossip_state, "intra": intra_state}

    def check_state(self, state: dict[str, Any], *, on_world_size_change: str = "error") -> None:
        """Raise what :meth:`load_state_dict` would raise, changing nothing."""
        check_loadable(state, self.options, self._topology_arg,
                       on_world_size_change=on_world_size_change, warn=False)

    # -----------------------------------------------------------------------------------------
    # pickling: options and counters travel, process groups and buffers never do

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "comm_stats": self.comm_stats, "steps": self.steps,
                "skipped_steps": self.skipped_steps, "owner": self.owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self.comm_stats = state["comm_stats"]
        self.clock = StepClock(state["steps"])
        self._kind = gossip_class(self.options.gossip_config())
        self.skipped_steps = state["skipped_steps"]
        self.owner = state["owner"]
        self._topology_arg = None
        self._pending = None
        self._warned_env = False
        self._buffers = None   # the model is not the optimizer's to pickle
        self._reset_runtime()

