"""HierarchicalOptimizer: any torch optimizer on qcomm's hierarchical communication.

    opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), bits=4)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # node mean of the gradients, AdamW's own update, gossip between nodes
    opt.average_parameters()

The wrapped optimizer keeps its update rule, its param groups and its state; this class adds the
:class:`~qcomm.engine.AveragingEngine` around its ``step()``. It is itself a
``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` are the wrapped
optimizer's (the same objects, so LR schedulers and code that edits groups work), step hooks
registered on it run around the whole step, torch's global step hooks
(``register_optimizer_step_pre_hook`` / ``_post_hook``) run once per step, around it, the
wrapped optimizer's own step hooks around its update, and ``state_dict()`` is the wrapped
optimizer's plus one ``"qcomm"`` entry.

With one process (no process group, or world size 1) a step is exactly the wrapped optimizer's
step, bit for bit, plus a finiteness check of the gradients in host memory that changes no
value. It reads no value on an accelerator (no host sync the wrapped optimizer does not make)
unless ``on_nonfinite="skip"`` asks for the check there too (one read per device and step).
Meta and fake parameters are stepped wherever the wrapped optimizer steps them. torch.optim's
generic optimizer tests run against it: ``tests/sgd/test_drop_in.py``.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from qcomm.checkpoint.optimizer import STATE_KEY, CheckpointableOptimizer
from qcomm.collectives.topology import Topology
from qcomm.engine import AveragingEngine, CommOptions
from qcomm.engine.options import user_stacklevel
from qcomm.sgd.lightning_guard import check_lightning_strategy
from qcomm.validation import check_instance

__all__ = ["STATE_KEY", "HierarchicalOptimizer"]

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def _forwarded(name: str) -> property:
    """An attribute of the wrapper that reads, sets and deletes the wrapped optimizer's."""
    return property(lambda self: getattr(self.optimizer, name, None),
                    lambda self, value: setattr(self.optimizer, name, value),
                    lambda self: delattr(self.optimizer, name),
                    doc=f"The wrapped optimizer's ``{name}`` (None when it has none).")


class HierarchicalOptimizer(Optimizer, CheckpointableOptimizer):
    """Wraps ``optimizer`` with hierarchical communication: gradients averaged inside each node
    (synchronous, full precision by default), parameters gossiped between nodes (asynchronous,
    compressed, CHOCO with error feedback).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (AdamW, Adam, SGD, Adafactor, ...) whose
            ``step()`` works from ``.grad``. Optimizers that re-evaluate a closure inside
            ``step()`` (LBFGS) are not supported: the closure is evaluated once, before the
            gradients are averaged.
        layout: the job's :class:`~qcomm.collectives.Topology`; None (default) builds it at the
            first distributed step from torch.distributed and ``procs_per_node`` /
            torchrun's ``LOCAL_WORLD_SIZE``.
        comm: a :class:`~qcomm.engine.CommOptions`, the one place every communication option
            is defined, validated and documented (bits, graph, schedule, timeouts, ...); None:
            its defaults.
        **comm_options: the same options as keywords (a convenience: they build the
            CommOptions, replacing fields of ``comm`` when both are given); an unknown name
            raises TypeError listing the accepted ones.

    Every rank must start from the same parameters and call :meth:`step` the same number of
    times. The first distributed step creates the process groups (collective).

    Parameters may be real or complex (a complex one is averaged and gossiped as its real view,
    two floats per value), on any device; the wrapped optimizer's arguments (``foreach``,
    ``fused``, ``capturable``, a tensor ``lr``, ...) keep their meaning.

    Limits of "drop-in", each an error naming it rather than a silent difference:

    * gradients must be dense: a sparse gradient raises TypeError, in one process too (the
      communication has no sparse path, and a job should not fail only when it scales out);
    * ``differentiable=True`` needs a single process (ValueError with peers, at construction,
      ``add_param_group``, ``load_state_dict`` or the first step): the gradient mean and the
      gossip run outside autograd;
    * the parameters that require a gradient at the first distributed step are the ones
      communicated: unfreezing one later raises ValueError, and ``add_param_group`` after that
      step raises RuntimeError;
    * a closure is evaluated once, before the gradients are averaged (no LBFGS);
    * on ``fused=True`` optimizers, GradScaler takes its generic path (unscale, check, step):
      this wrapper does not claim ``_step_supports_amp_scaling``, since its finiteness check
      and gradient mean run before the wrapped optimizer's step, on the gradients as they are
      (scaled ones would overflow there first). ``grad_scale`` / ``found_inf`` set on it
      reach the wrapped optimizer.
    """

    def __init__(self, optimizer: Optimizer, *, layout: Topology | None = None,
                 comm: CommOptions | None = None, **comm_options: Any) -> None:
        check_instance("optimizer", optimizer, Optimizer, what="a torch.optim.Optimizer")
        if isinstance(optimizer, HierarchicalOptimizer):
            raise TypeError("optimizer is already a HierarchicalOptimizer; wrap the inner "
                            "torch optimizer once")
        # Its warnings point at the caller's line, through subclass constructors too.
        self.comm = CommOptions.from_kwargs(comm_options, comm)
        if self.comm.outer_momentum and "betas" in optimizer.defaults:
            warnings.warn(
                f"outer_momentum={self.comm.outer_momentum:g} around "
                f"{type(optimizer).__name__}: with an adaptive optimizer the outer momentum "
                "was measured to hurt (a transformer with AdamW never reached its target "
                "loss with it); the README's ADAMW_SLOW_LINK uses none", UserWarning,
                stacklevel=user_stacklevel())
        self._attach(optimizer, layout)
        self.engine.check_groups(optimizer.param_groups)

    def _attach(self, optimizer: Optimizer, layout: Topology | None) -> None:
        """The torch.optim.Optimizer machinery (hooks, step patching) without copying the
        wrapped optimizer's groups: ``param_groups``/``state`` are forwarded to it."""
        self.optimizer = optimizer
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.engine = AveragingEngine(optimizer, self.comm, topology=layout)

    # -----------------------------------------------------------------------------------------
    # the wrapped optimizer's surface

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # Fused optimizers read ``grad_scale`` / ``found_inf`` (float32 scalar tensors: the scale
    # to divide the gradients by, and > 0 when a gradient overflowed: skip) as attributes of
    # themselves; set on this wrapper, they reach the wrapped optimizer. GradScaler itself
    # does not set them here (this wrapper does not claim ``_step_supports_amp_scaling``, so
    # GradScaler unscales and checks before ``step()``, as for any optimizer).
    grad_scale = _forwarded("grad_scale")
    found_inf = _forwarded("found_inf")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As the wrapped optimizer's; not after the first distributed step (the layout of the
        communicated parameters is fixed then)."""
        if self.engine.topology is not None:
            raise RuntimeError("add_param_group after the first distributed step is not "
                               "supported: the communicated parameters are fixed")
        if isinstance(param_group, dict):
            self.engine.check_groups([{**self.defaults, **param_group}])
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; also ends what :meth:`sync_gradients` did
        for the discarded gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.engine.discard_sync()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r}, {self.comm})"

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; ours forward to the
        # wrapped optimizer, which pickles itself. The engine drops its process groups.
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._patch_step_function()

    # -----------------------------------------------------------------------------------------
    # the step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Node mean of the gradients (unless :meth:`sync_gradients` did it), the wrapped
        optimizer's step, then the gossip round. Returns the closure's loss, if any.

        Raises:
            NonFiniteGradientError: a gradient holds NaN/Inf and ``on_nonfinite="raise"``;
                nothing was changed.
            WrongStrategyError: with peers, Lightning steps it under a strategy other than
                ``qcomm.integrations.lightning.QcommStrategy`` (:mod:`qcomm.sgd.lightning_guard`);
                nothing was changed.
        """
        if closure is not None and self.engine.distributed:
            check_lightning_strategy(closure, self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            go = self.engine.sync_gradients()
        if not go:
            self.engine.skip_step()
            return loss
        self._inner_step()
        with torch.no_grad():
            self.engine.finish_step()
        return loss

    def _inner_step(self) -> None:
        """The wrapped optimizer's update with its own step hooks, without the global ones
        (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``): torch
        runs those around every ``Optimizer.step``, so they already ran around this wrapper's,
        and the user made one step."""
        inner = self.optimizer
        patched = type(inner).step
        raw = getattr(patched, "__wrapped__", None)
        override = vars(inner).get("step")
        if raw is None or not getattr(patched, "hooked", False) or (
                override is not None and not getattr(override, "_wrapped_by_lr_sched", False)):
            # Not torch's hooked step, or an instance override we know nothing of: run it as
            # its owner set it up.
            inner.step()
            return
        if override is not None:
            # A scheduler built on the wrapped optimizer counts its steps through this flag.
            inner._opt_called = True  # type: ignore[attr-defined]
        # What torch's step wrapper (Optimizer.profile_hook_step) does, less the global hooks.
        args: tuple[Any, ...] = (inner,)
        kwargs: dict[str, Any] = {}
        with torch.autograd.profiler.record_function(
                f"Optimizer.step#{type(inner).__name__}.step"):
            for hook in inner._optimizer_step_pre_hooks.values():
                result = hook(inner, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"a step pre-hook must return None or a tuple of "
                                           f"(new_args, new_kwargs), got {result}")
                    args, kwargs = result
            raw(*args, **kwargs)
            inner._optimizer_step_code()
            for hook in inner._optimizer_step_post_hooks.values():
                hook(inner, args, kwargs)

    def sync_gradients(self) -> bool:
        """Average the gradients over the node's ranks now, as DDP does during backward.

        For code that needs the node's gradients between backward and :meth:`step`: gradient
        clipping, ``GradScaler.unscale_``, logging the gradient norm. :meth:`step` then uses
        them as they are (clipped, unscaled). Covers the gradients until the next
        :meth:`step` or :meth:`zero_grad`. Collective over the node (and over the nodes with
        ``on_nonfinite="skip"``): every rank calls it at the same point.

        Returns:
            False when the step will be skipped (non-finite gradients, ``on_nonfinite="skip"``).
        """
        with torch.no_grad():
            return self.engine.sync_gradients()

    def data_parallel(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """``model`` wrapped in ``DistributedDataParallel`` over this node's ranks: gradients
        are averaged inside the node during backward (bucketed, overlapped with it) and
        :meth:`step` no longer averages them. Collective (creates the process groups). Returns
        ``model`` unchanged when alone on the node. Attaches ``model`` (:meth:`attach`). See
        :meth:`qcomm.engine.AveragingEngine.data_parallel`."""
        return self.engine.data_parallel(model, **ddp_kwargs)

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model``'s buffers (BatchNorm's running statistics and counters) agree as
        its parameters do: over the node's ranks after every step, over every rank after
        :meth:`average_parameters` (floating buffers their exact mean, integer ones their
        maximum). Between two averages each node keeps its own statistics. For models not
        wrapped with :meth:`data_parallel` (which attaches its model itself). Call it before
        the first step; not collective. Returns ``model``.

        Raises:
            ValueError: none of ``model``'s parameters is this optimizer's.
            RuntimeError: after the first distributed step.
        """
        self.engine.attach(model)
        return model

    # -----------------------------------------------------------------------------------------
    # evaluation, statistics, shutdown

    def average_parameters(self) -> None:
        """Set every rank's parameters to the exact global mean (collective: every rank calls it
        at the same point). Completes the gossip rounds in flight first; all ranks end with the
        same bytes. For evaluation and the final checkpoint. No-op in a single process.

        Buffers (BatchNorm's running statistics) are averaged only for a model given to
        :meth:`attach` or :meth:`data_parallel`; without one, every rank keeps its own buffers
        and ``eval()`` outputs may differ between ranks."""
        self.engine.average_parameters()

    def stats(self, *, consensus: bool = False) -> dict[str, Any]:
        """Steps, bytes and messages sent per level, gossip progress; see
        :meth:`qcomm.engine.AveragingEngine.stats`."""
        return self.engine.stats(consensus=consensus)

    def node_any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank of this node (collective over the node):
        how the ranks of a node agree to stop a per-node time budget at the same step. See
        :meth:`qcomm.engine.AveragingEngine.node_any`."""
        return self.engine.node_any(flag)

    def job_progress(self) -> int:
        """The job's progress in local steps as this node knows it, the same on every rank of
        the node (collective over the node's ranks): drive a learning-rate schedule by it when
        nodes run at different speeds, so a slow node decays with the job. See
        :meth:`qcomm.engine.AveragingEngine.job_progress`."""
        return self.engine.job_progress()

    def flush(self) -> None:
        """Wait for the gossip rounds in flight (collective: every rank at the same step); the
        parameters do not change. See :meth:`qcomm.engine.AveragingEngine.flush`."""
        self.engine.flush()

    def close(self) -> None:
        """Complete the gossip rounds in flight (when peers still answer) and release the
        transport and process-group references, so ``destroy_process_group()`` is safe. Never
        raises a peer's failure. Idempotent."""
        self.engine.close()

    def __enter__(self) -> HierarchicalOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` plus ``"qcomm"``: this rank's communication
        state (geometry, counters, gossip rounds in flight, byte counters). One rank's state:
        save one file per rank (:func:`qcomm.sgd.save_checkpoint`)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = self.optimizer.state_dict()
        sd[STATE_KEY] = self.engine.state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], *,
                        on_world_size_change: str = "error") -> None:
        """Load a state saved by :meth:`state_dict` on the same rank (a plain state dict of the
        wrapped optimizer is accepted too: the communication state then starts fresh).

        Args:
            state_dict: from :meth:`state_dict`.
            on_world_size_change: ``"error"`` (default) raises ValueError naming both world
                sizes when the geometry differs; ``"reinit"`` keeps the optimizer state and
                restarts the gossip state (warned; see :mod:`qcomm.engine.state`).

        Nothing is changed when an error is raised.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        sd = dict(state_dict)
        engine_state = sd.pop(STATE_KEY, None)
        self._check_groups(sd)
        self.engine.check_groups([{**self.defaults, **g} for g in sd.get("param_groups", [])])
        if engine_state is not None:
            self.engine.check_state(engine_state, on_world_size_change=on_world_size_change)
        self.optimizer.load_state_dict(sd)
        if engine_state is not None:
            self.engine.load_state_dict(engine_state, on_world_size_change=on_world_size_change)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _check_groups(self, state_dict: dict[str, Any]) -> None:
        """Validate the saved param groups before anything loads (subclasses add checks)."""
