"""One model's communication across nodes: the layer between the collectives and the optimizers.

The optimizers (:mod:`qcomm.sgd`) own the update rule; the engine owns everything that crosses a
link: per step ``sync_gradients()``, the wrapped optimizer's update, ``finish_step()``
(:mod:`qcomm.engine.step`); outside the loop ``average_parameters()`` (exact global mean),
``stats()``, ``state_dict()`` and ``close()``.

:class:`AveragingEngine` coordinates small objects, one job each: where this rank runs
(:mod:`.placement`), what it is attached to (:mod:`.attachment`), what the first distributed
step builds (:mod:`.runtime`: process groups, created lazily and collectively, never in a
constructor), the step (:mod:`.step`), the checkpoint entry (:mod:`.state`) and the statistics
(:mod:`.report`). One step clock counts the run's steps; the gossip advances it.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from qcomm.collectives.gossip.clock import StepClock
from qcomm.collectives.gossip.factory import mode_class
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.engine.attachment import Attachment
from qcomm.engine.options import CommOptions
from qcomm.engine.placement import Placement
from qcomm.engine.report import engine_stats, log_topology
from qcomm.engine.runtime import Runtime, build_runtime
from qcomm.engine.state import EngineState
from qcomm.engine.step import StepCycle, job_progress, node_any
from qcomm.validation import check_instance

__all__ = ["AveragingEngine"]


class AveragingEngine:
    """Hierarchical averaging of one model: intra-node gradient mean, inter-node gossip.

    Args:
        owner: the optimizer whose ``param_groups`` hold the parameters (read at every use, so
            groups added before the first distributed step and a ``load_state_dict`` that
            replaces the group list are seen); each parameter is taken once, in group order.
        options: the communication options.
        topology: how the job's ranks map to nodes; None builds one from torch.distributed and
            torchrun's environment at the first distributed step (or takes a linked node's,
            :func:`qcomm.rendezvous.init_node`). Pass one built over an in-memory world
            (:mod:`qcomm.collectives.memory`) to run in-process.

    The constructor communicates nothing and creates no process group.
    """

    def __init__(self, owner: Any, options: CommOptions, *,
                 topology: Topology | None = None) -> None:
        check_instance("options", options, CommOptions, what="a qcomm.engine.CommOptions")
        check_instance("topology", topology, Topology, allow_none=True,
                       what="a qcomm.collectives.Topology")
        self._assemble(owner, options, Placement(options, topology), CommStats(), StepClock())

    def _assemble(self, owner: Any, options: CommOptions, placement: Placement,
                  comm_stats: CommStats, clock: StepClock, skipped_steps: int = 0) -> None:
        """The rooms, built once (a new engine, or an unpickled one)."""
        self.options, self.comm_stats = options, comm_stats
        self.clock = clock   # the run's steps: the gossip advances it, or else finish_step
        self._placement = placement
        self._attached = Attachment(owner)
        self._kind = mode_class(options.wait_free)   # the gossip's mode, asked
        self._step = StepCycle(options, clock, self._kind.lockstep, self._attached, placement,
                               skipped_steps)
        self._state = EngineState(options, placement)
        self._runtime: Runtime | None = None   # built at the first distributed step
        self._closed = False

    # -----------------------------------------------------------------------------------------
    # where are we

    @property
    def owner(self) -> Any:
        """The optimizer whose parameters are communicated."""
        return self._attached.owner

    @property
    def steps(self) -> int:
        """Steps applied: the run's clock (the gossip advances it when there is one, and says
        from it when a round is due)."""
        return self.clock.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``on_nonfinite="skip"``)."""
        return self._step.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._step.skipped_steps = value

    @property
    def distributed(self) -> bool:
        """True when this rank has peers (a topology, or else a process group, of several
        ranks)."""
        return self._placement.distributed

    @property
    def topology(self) -> Topology | None:
        """The job's topology once the first distributed step ran (or :meth:`setup` was called)."""
        return self._runtime.topology if self._runtime is not None else None

    def geometry(self) -> tuple[int, int, int]:
        """(world size, ranks per node, rank) of this run, without any collective."""
        return self._placement.geometry()

    def check_groups(self, groups: list[dict[str, Any]]) -> None:
        """Raise ValueError when this rank has peers and a param group (the optimizer's, or a
        state dict's) asks for ``differentiable=True`` (the communication runs outside
        autograd); DTensor parameters are checked in any process (:meth:`sharding`)."""
        self._placement.check_groups(groups, self.owner.param_groups)

    def sharding(self, groups: list[dict[str, Any]] | None = None,
                 topology: Topology | None = None) -> bool:
        """Whether the parameters of ``groups`` (None: the optimizer's) are FSDP2 shards of
        this node's ranks (no communication). Raises ShardedParamsError for DTensors of any
        other kind, mixed with plain ones, or with an option that cannot work sharded."""
        return self._placement.sharding(
            self.owner.param_groups if groups is None else groups, topology)

    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, each once, in param-group order."""
        return self._attached.params()

    def locate(self, param: torch.Tensor) -> tuple[int, int]:
        """``(group index, index in the group)`` of ``param``."""
        return self._attached.locate(param)

    # -----------------------------------------------------------------------------------------
    # set-up (lazy: constructors must not run collectives) and attachment

    def setup(self) -> None:
        """Create the process groups and the communication objects (collective: every rank
        calls it at the same point; the first distributed step does). Idempotent."""
        self._live()

    def _live(self) -> Runtime:
        """The runtime, built now when it is not yet (:func:`~.runtime.build_runtime`)."""
        if self._runtime is not None:
            return self._runtime
        if self._closed:
            raise RuntimeError("the engine is closed")
        rt = build_runtime(self.options, self._placement, self._attached, self.comm_stats,
                           self.clock)
        self._state.apply_pending(rt)
        self._runtime = rt
        log_topology(rt.topology, self.options, self._attached.ddp_intra,
                     rt.node.flat.numel if rt.node else 0,
                     rt.node.gossip.gamma if rt.node else None, sharded=rt.sharded)
        return rt

    def attach(self, model: torch.nn.Module, *, kept_by_ddp: bool = False) -> None:
        """Register ``model``'s buffers: they agree over the node's ranks after every step and
        over every rank after :meth:`average_parameters` (:mod:`qcomm.engine.buffers`). Not
        collective; before the first distributed step (attaching again replaces the model).
        ``kept_by_ddp``: DDP (``broadcast_buffers=True``) keeps them in step in the node."""
        self._attached.attach(model, kept_by_ddp=kept_by_ddp, ready=self._runtime is not None)

    def data_parallel(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Wrap ``model`` in ``DistributedDataParallel`` over this node's ranks (gradients are
        then averaged inside the node in backward, not in :meth:`sync_gradients`). Collective.
        Returns ``model`` itself alone on the node or not distributed; attaches it in every
        case. Raises ValueError with ``intra_bits`` (DDP averages in full precision), TypeError
        on a topology whose world is not torch.distributed's."""
        return self._attached.data_parallel(
            model, self.options, self._placement, ready=self._runtime is not None,
            setup=lambda: self._live().topology, **ddp_kwargs)

    # -----------------------------------------------------------------------------------------
    # one step (qcomm.engine.step)

    def sync_gradients(self) -> bool:
        """Average the gradients over the node's ranks now and agree on finiteness (right after
        backward when something before ``step()`` needs the node's gradients: clipping,
        GradScaler's unscale; ``step()`` then does not average them again). Returns False when
        the step will be skipped (``on_nonfinite="skip"``). Raises NonFiniteGradientError (a
        NaN/Inf gradient, ``on_nonfinite="raise"``: nothing changed), TypeError (sparse)."""
        return self._step.sync(self._runtime, self._live)

    def finish_step(self) -> None:
        """After the local update: when a round is due (every ``sync_every / fragments``
        steps), the gossip round of the next fragment of the communicated parameters (those
        without a gradient this step are left as they are)."""
        self._step.finish(self._runtime)

    def skip_step(self) -> None:
        """End a step that :meth:`sync_gradients` voted to skip."""
        self._step.skip(self._runtime)

    def discard_sync(self) -> None:
        """The gradients were dropped (``zero_grad``): the next :meth:`sync_gradients` averages
        afresh."""
        self._step.synced = False

    def node_any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank of this node (collective over its ranks).
        Wait-free nodes may run different numbers of steps, but a node's ranks take the same
        ones: end a per-node budget with ``if opt.node_any(time.monotonic() > t): break``."""
        flag = bool(flag)
        if not self.distributed:
            return flag
        return node_any(flag, self._live().topology, self.options.timeout_s)

    def job_progress(self) -> int:
        """The job's progress in steps as this node knows it (:func:`.step.job_progress`)."""
        rt = self._live() if self.distributed else None
        return self.steps if rt is None else job_progress(
            self.steps, rt.gossip, rt.topology, self.options.timeout_s)

    # -----------------------------------------------------------------------------------------
    # evaluation, statistics, shutdown

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Set every rank's communicated parameters to their exact global mean (collective).
        Completes the gossip rounds in flight first; all ranks end with the same bytes. The
        attached model's buffers (:meth:`attach`) too: floating ones to their exact mean,
        integer ones to their maximum; without an attached model buffers are not touched."""
        if self.distributed:
            self._live().average(self._attached.buffers, self.options.timeout_s)

    def stats(self, *, consensus: bool = False) -> dict[str, Any]:
        """What this rank sent and how the gossip is doing (the keys:
        :func:`qcomm.engine.report.engine_stats`). ``consensus``: also compute the consensus
        distance (a collective over the rail: every rank calls it at the same point)."""
        rt = self._runtime
        node = rt.node if rt is not None else None
        return engine_stats(self.steps, self.skipped_steps, self.comm_stats,
                            node.gossip if node else None, self._kind, self.options,
                            consensus_of=node if consensus else None)

    def flush(self) -> None:
        """Wait for the gossip rounds in flight and apply them to the public copies (collective
        over the rail). After it, every byte :meth:`stats` counted has been delivered."""
        if self._runtime is not None:
            self._runtime.flush()

    def close(self) -> None:
        """Complete the gossip rounds in flight (when the peers still answer) and release the
        transport and every process-group reference. Never raises a peer's failure. Idempotent."""
        if self._runtime is not None:
            self._runtime.close()
        self._runtime = None
        self._attached.ddp_intra = False
        self._step.reset()
        self._closed = True
        # Works and groups can sit in reference cycles (a round and its transport); collect
        # them now, before the caller destroys the process group, not at interpreter exit,
        # when Gloo aborts on pending works.
        gc.collect()

    # -----------------------------------------------------------------------------------------
    # checkpoints (qcomm.engine.state) and pickling

    def state_dict(self) -> dict[str, Any]:
        """This rank's communication state (:mod:`qcomm.engine.state`). With ``wait_free`` it
        drains the gossip first, a collective over the rail: every rank saves at the same
        point (as :func:`qcomm.sgd.save_checkpoint` does)."""
        return self._state.save(self._runtime, self.clock, self.skipped_steps, self.comm_stats)

    def load_state_dict(self, state: dict[str, Any], *,
                        on_world_size_change: str = "error") -> None:
        """Load :meth:`state_dict` output. Validates first: nothing changes when it raises. See
        :func:`qcomm.engine.state.check_loadable`."""
        self._state.load(state, self._runtime, self.clock, self._step, self.comm_stats,
                         on_world_size_change)

    def check_state(self, state: dict[str, Any], *, on_world_size_change: str = "error") -> None:
        """Raise what :meth:`load_state_dict` would raise, changing nothing."""
        self._state.check(state, on_world_size_change)

    def __getstate__(self) -> dict[str, Any]:
        # options and counters travel; process groups, buffers and the model never do
        return {"options": self.options, "comm_stats": self.comm_stats, "steps": self.steps,
                "skipped_steps": self.skipped_steps, "owner": self.owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = state["options"]
        self._assemble(state["owner"], options, Placement(options, None, linked=False),
                       state["comm_stats"], StepClock(state["steps"]), state["skipped_steps"])
