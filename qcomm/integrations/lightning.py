"""``QcommStrategy``: Lightning's DDP inside each node, qcomm's compressed gossip between nodes.

    import lightning as L
    from qcomm.integrations.lightning import QcommStrategy
    from qcomm.sgd import SLOW_LINK

    trainer = L.Trainer(num_nodes=2, devices=8, strategy=QcommStrategy(**SLOW_LINK))
    trainer.fit(model)    # model.configure_optimizers() returns torch.optim.SGD/AdamW as before

The strategy wraps the one torch optimizer ``configure_optimizers`` returns into a
:class:`~qcomm.sgd.HierarchicalOptimizer` (its LR schedulers step it as before: the param
groups are the same objects) and the model in DDP over the node's ranks only; between nodes
only qcomm's quantized gossip crosses the link. Every rank averages its parameters
(``average_parameters()``) before validation, test and predict, before every checkpoint and at
the end of ``fit``: each rank evaluates and saves one model. A checkpoint is Lightning's file
(rank 0's optimizer state, the averaged model) plus ``<file>.qcomm/``: one file per rank with
that rank's optimizer and gossip state, so that ``Trainer.fit(ckpt_path=...)`` goes on with the
bits of the run that did not stop. ``opt.stats()`` (this rank's: rank 0's reach the loggers) is
logged through the Trainer's loggers every ``log_every_n_steps`` and shown in the progress bar.
With ``QCOMM_RENDEZVOUS`` set (one torchrun per node, ``python -m qcomm.rendezvous`` linking them)
the node is Lightning's world and takes its seat at the rendezvous (docs/guide.md, "Lightning").

Needs Lightning 2.x, the ``lightning`` extra: ``pip install 'qcomm[lightning]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - exercised in a process without lightning
    raise ImportError(
        "qcomm.integrations.lightning needs Lightning 2.x (the package `lightning`): "
        "pip install 'qcomm[lightning]'") from exc

import torch

from qcomm.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from qcomm.checkpoint.optimizer import STATE_KEY
from qcomm.engine import CommOptions
from qcomm.rendezvous.node import init_node, linked_seat
from qcomm.rendezvous.seat import ENV_VAR as RENDEZVOUS_ENV
from qcomm.sgd.hierarchical_optimizer import HierarchicalOptimizer
from qcomm.sgd.lightning_guard import OWNED_FLAG
from qcomm.sgd.monitor import stats_scalars
from qcomm.validation import check_instance

__all__ = ["QcommStrategy", "rank_state_dir"]

# Shown in the progress bar: what a user watches on a slow link.
_BAR = ("qcomm/bytes_inter", "qcomm/live_nodes")


def rank_state_dir(filepath: str | os.PathLike) -> Path:
    """The directory beside a Lightning checkpoint file that holds every rank's qcomm state
    (``<file>.qcomm/rank00000.pt`` ...; :func:`qcomm.sgd.save_checkpoint`'s layout)."""
    return Path(str(filepath) + ".qcomm")


class _AverageFirst(pl.Callback):
    """Averages the ranks' parameters before validation, test and predict and at the end of
    ``fit``, ahead of every other callback (QcommStrategy puts it first)."""

    def __init__(self, strategy: QcommStrategy) -> None:
        self.strategy = strategy

    def on_validation_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.strategy.average()

    def on_test_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.strategy.average()

    def on_predict_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.strategy.average()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # The model fit returns is the same on every rank.
        self.strategy.average()


class QcommStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with DDP over the node's ranks only and qcomm between nodes.

    Args:
        comm: a :class:`~qcomm.engine.CommOptions` (None: its defaults).
        **comm_options: its fields as keywords (``**SLOW_LINK``, ``**ADAMW_SLOW_LINK``,
            ``bits=4``, ``procs_per_node=2``, ...), replacing fields of ``comm``; an unknown
            name raises TypeError listing the accepted ones. ``procs_per_node`` left at None
            is Lightning's ``devices`` (``Trainer(num_nodes=N, devices=K)``: N nodes of K);
            set it to emulate several nodes on one machine.
        ddp_kwargs: keyword arguments of the node's ``DistributedDataParallel``
            (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ...).
        log_stats: log ``opt.stats()`` through the Trainer's loggers every
            ``log_every_n_steps`` and show bytes between nodes and live nodes in the progress
            bar (default True).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as Lightning's ``DDPStrategy``.

    Under a GradScaler (``precision="16-mixed"``) the scaler decides which steps to skip, as
    under DDP: after the last backward of each step the nodes vote (in lockstep every node
    skips a step that overflowed on any; wait-free each node on its own) and every rank that
    skips hands its scaler non-finite gradients, so that every scaler skips that step and
    lowers its scale alike. The optimizer's ``on_nonfinite`` is ``"skip"`` under it.

    Refused, each with an error that names it: ``configure_optimizers`` returning several
    optimizers, or a qcomm optimizer (return the torch optimizer: the strategy wraps it);
    ``sync_batchnorm=True`` (it would all-reduce every BatchNorm over every rank in each
    forward; ``average_parameters()`` averages the statistics instead); a qcomm optimizer
    stepped by any other Lightning strategy (:class:`~qcomm.integrations.WrongStrategyError`);
    ``on_nonfinite="raise"`` given with a GradScaler (its overflows would end the fit).
    """

    strategy_name = "qcomm"

    def __init__(self, *, comm: CommOptions | None = None,
                 ddp_kwargs: dict[str, Any] | None = None, log_stats: bool = True,
                 accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 **comm_options: Any) -> None:
        # Validated now, in the user's process, before any process is started.
        self.comm = CommOptions.from_kwargs(comm_options, comm)
        self._raise_asked = comm_options.get("on_nonfinite") == "raise"
        if ddp_kwargs is not None and not isinstance(ddp_kwargs, dict):
            raise TypeError(f"ddp_kwargs must be a dict of DistributedDataParallel's keyword "
                            f"arguments, got {type(ddp_kwargs).__name__}")
        if not isinstance(log_stats, bool):
            raise TypeError(f"log_stats must be True or False, got {log_stats!r}")
        # Lightning hands it on unchecked (to torch.distributed, or the rendezvous's timeout).
        check_instance("timeout", timeout, timedelta, allow_none=True,
                       what="a datetime.timedelta")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method, **(ddp_kwargs or {}))
        self._log_stats = log_stats
        self._qcomm: HierarchicalOptimizer | None = None
        self._resume_path: Path | None = None

    # -----------------------------------------------------------------------------------------
    # the process group: Lightning's, or the node's seat at qcomm's rendezvous

    def setup_distributed(self) -> None:
        """As ``DDPStrategy``'s, except with ``QCOMM_RENDEZVOUS`` set (one torchrun per node,
        ``python -m qcomm.rendezvous`` linking them): :func:`qcomm.rendezvous.init_node` makes
        the node's group, Lightning's world, and takes the node's seat, through which the
        optimizer links to the other nodes. A group made before ``fit`` (``init_node()`` in
        the script) is used as it is, as Lightning does."""
        if not os.environ.get(RENDEZVOUS_ENV) or torch.distributed.is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        init_node(backend=self._process_group_backend,
                  timeout_s=self._timeout.total_seconds() if self._timeout else 300.0)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Linked nodes: Lightning's world is the node, so its sampler would hand every node
        # the same shards; the job's ranks split the data instead.
        seat = linked_seat()
        if seat is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": seat.world_size, "rank": seat.rank}

    # -----------------------------------------------------------------------------------------
    # the optimizer and the model

    @property
    def qcomm_optimizer(self) -> HierarchicalOptimizer | None:
        """The qcomm optimizer of the fit in progress (None outside ``fit``)."""
        return self._qcomm

    def layout_options(self) -> CommOptions:
        """The communication options with the node size filled in: ``procs_per_node`` as
        given, else Lightning's processes per node (``devices``); ``on_nonfinite="skip"``
        under a GradScaler."""
        comm = self.comm
        if comm.procs_per_node is None:
            comm = dataclasses.replace(comm, procs_per_node=max(1, self.num_processes))
        if self._scaler() is not None:
            comm = dataclasses.replace(comm, on_nonfinite="skip")
        return comm

    def _scaler(self) -> Any:
        """The precision plugin's GradScaler (``precision="16-mixed"``), else None."""
        return getattr(self.precision_plugin, "scaler", None)

    def setup(self, trainer: pl.Trainer) -> None:
        """As ``DDPStrategy.setup``, with the optimizer wrapped before the model: the node's
        DDP is made by the qcomm optimizer (:meth:`HierarchicalOptimizer.data_parallel`)."""
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        if self._raise_asked and self._scaler() is not None:
            raise ValueError(
                "on_nonfinite='raise' under a GradScaler (precision='16-mixed'): the scaler "
                "skips the steps whose gradients overflow and lowers its scale, and 'raise' "
                "would end the fit at the first of them; leave on_nonfinite out (QcommStrategy "
                "then skips them with the scaler, on every node alike)")
        if self._layer_sync is not None:
            raise ValueError(
                "sync_batchnorm=True under QcommStrategy: SyncBatchNorm all-reduces every "
                "BatchNorm over every rank in each forward, across the slow link; leave it "
                "False (average_parameters() averages the statistics before evaluation and "
                "checkpoints)")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)
        self.configure_ddp()
        # Lightning runs the callbacks' hooks, then the module's, then the strategy's: the
        # averaging goes first in the callbacks, so that every hook sees one model.
        if not any(isinstance(c, _AverageFirst) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _AverageFirst(self))
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The user's optimizers and schedulers, the one optimizer wrapped into a
        :class:`~qcomm.sgd.HierarchicalOptimizer` (schedulers keep stepping it: its param
        groups are the wrapped optimizer's)."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"QcommStrategy needs configure_optimizers to return exactly one optimizer, got "
                f"{len(self.optimizers)}: qcomm averages one model's parameters with one "
                "optimizer")
        inner = self.optimizers[0]
        if isinstance(inner, HierarchicalOptimizer):
            raise TypeError(
                f"configure_optimizers returned a qcomm {type(inner).__name__}: under "
                "QcommStrategy return the plain torch optimizer (torch.optim.SGD, AdamW, ...) "
                "and give the communication options to QcommStrategy(...), which wraps it")
        opt = HierarchicalOptimizer(inner, comm=self.layout_options())
        setattr(opt, OWNED_FLAG, True)
        self._qcomm = opt
        self.optimizers = [opt]

    def configure_ddp(self) -> None:
        """DDP over the node's ranks (the model itself with one rank per node)."""
        assert self._qcomm is not None and self.model is not None
        kwargs = dict(self._ddp_kwargs)
        device_ids = self.determine_ddp_device_ids()
        if device_ids is not None:
            kwargs.setdefault("device_ids", device_ids)
        self.model = self._qcomm.data_parallel(self.model, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """As ``DDPStrategy``'s; under a GradScaler the nodes vote on the step right after its
        last backward, before the scaler unscales and checks the gradients."""
        if self._qcomm is None or self._scaler() is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_vote() -> Any:
            result = closure()
            # Lightning skips the step when an automatic training_step returned None (no
            # backward ran); otherwise the scaler steps or skips it.
            if result is not None or not self.lightning_module.automatic_optimization:
                self._vote_on_step()
            return result

        return super().optimizer_step(optimizer, closure_then_vote, model, **kwargs)

    def _vote_on_step(self) -> None:
        """The nodes agree on the step (:meth:`HierarchicalOptimizer.sync_gradients`, the
        gradients being node means already: DDP's); a rank whose node must skip a step it
        found finite voids its gradients, so that its scaler skips it too and lowers its scale
        as the overflowing node's does (as DDP's all-reduce spreads an Inf to every rank)."""
        assert self._qcomm is not None
        if self._qcomm.sync_gradients():
            return
        with torch.no_grad():
            for group in self._qcomm.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))

    # -----------------------------------------------------------------------------------------
    # one model on every rank where one is looked at

    def average(self) -> None:
        """Every rank's parameters (and the model's buffers) to their exact global mean
        (collective: Lightning calls the hooks that call it on every rank at the same point).
        Nothing outside ``fit``: a model loaded for test or predict is one model already."""
        if self._qcomm is not None:
            self._qcomm.average_parameters()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Called on every rank for every checkpoint, before the optimizer states are read.
        self.average()
        return super().lightning_module_state_dict()

    # -----------------------------------------------------------------------------------------
    # statistics

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self._log_stats and self._qcomm is not None:
            self._report()
        return out

    def _report(self) -> None:
        """Every ``log_every_n_steps``: rank 0's figures to the loggers and the progress bar
        (between reports the bar keeps the last; no step pays for ``stats()`` otherwise)."""
        assert self._qcomm is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        if step % max(1, trainer.log_every_n_steps) != 0:
            return
        scalars = stats_scalars(self._qcomm.stats())
        if self.is_global_zero:
            # Straight to the loggers, in float64: Lightning's log() would store byte counts
            # in float32, exact only to 16 MB.
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step)
        if trainer.progress_bar_callback is not None:
            for name in _BAR:
                if name in scalars:
                    value = scalars[name] / 1e6 if name.endswith("bytes_inter") else scalars[name]
                    label = "qcomm/MB_inter" if name.endswith("bytes_inter") else name
                    self.lightning_module.log(label, value, prog_bar=True, logger=False,
                                              on_step=True, on_epoch=False, rank_zero_only=True)

    # -----------------------------------------------------------------------------------------
    # checkpoints: Lightning's file plus every rank's qcomm state beside it

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        # save_weights_only: no optimizer state in the file, none beside it.
        if self._qcomm is not None and "optimizer_states" in checkpoint:
            # Every rank its own file (collective over the rail with wait_free: it drains).
            save_checkpoint(rank_state_dir(filepath), self._qcomm)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        directory = rank_state_dir(filepath)
        own = checkpoint_path(directory, self.global_rank)
        for path in (own, own.with_suffix(".json")):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):   # the last rank to leave removes it
            directory.rmdir()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        self._resume_path = Path(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """This rank's own optimizer and gossip state from ``<file>.qcomm/``; a checkpoint
        without qcomm state (a plain DDP run's) loads rank 0's torch optimizer state and the
        gossip starts fresh."""
        if self._qcomm is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        directory = rank_state_dir(self._resume_path) if self._resume_path else None
        if directory is not None and directory.is_dir():
            load_checkpoint(directory, self._qcomm, restore_rng=False)
            return
        states = checkpoint.get("optimizer_states") or [{}]
        if STATE_KEY in states[0]:
            raise CheckpointError(
                f"{self._resume_path}: a QcommStrategy checkpoint without its ranks' qcomm "
                f"state, {directory} (each rank's optimizer and gossip state); copy it beside "
                "the file, or load only the weights (LightningModule.load_from_checkpoint)",
                directory)
        super().load_optimizer_state_dict(checkpoint)

    # -----------------------------------------------------------------------------------------
    # the end

    def teardown(self) -> None:
        # Before Lightning (or the user) destroys the process group.
        if self._qcomm is not None:
            self._qcomm.close()
            self._qcomm = None
        super().teardown()
