"""What the ranks of the Lightning tests run (module level: the pooled processes import it).

A tiny LightningModule on synthetic data, fitted by Lightning inside a Gloo world that the test
harness already started: Lightning sees ``LOCAL_RANK`` and takes the processes as launched
externally (as under torchrun), and finds the process group initialized.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

# 256 samples, batch 8, over 4 ranks: 8 steps per epoch and rank.
SAMPLES, BATCH, FEATURES = 256, 8, 8


@contextmanager
def lightning_env(rank: int) -> Iterator[None]:
    """The variables a launcher sets (Lightning reads LOCAL_RANK and NODE_RANK); restored
    after, so the pooled process serves other tests as it was."""
    keys = ("LOCAL_RANK", "NODE_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_module(make_optimizer: Callable[[torch.nn.Module], Any] | None = None) -> Any:
    """A 2-layer MLP classifier (8 -> 16 -> 2, 178 parameters) with SGD + StepLR, a validation
    step and a test step. ``make_optimizer``: what configure_optimizers returns instead."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 2))
            self.val_losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.val_losses.append(loss.item())
            self.log("val_loss", loss)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.validation_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            if make_optimizer is not None:
                return make_optimizer(self)
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)}

    return Tiny()


def loader(shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=shuffle)


def trainer(strategy: Any, root: Path, epochs: int, **kwargs: Any) -> Any:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    kwargs.setdefault("logger", CSVLogger(root, name="logs", version=0))
    kwargs.setdefault("enable_progress_bar", False)
    return L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=epochs,
                     default_root_dir=root, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=2, log_every_n_steps=2,
                     **kwargs)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def fit_body(rank: int, world_size: int, root: str, epochs: int, resume: str | None,
             options: dict[str, Any]) -> dict[str, Any]:
    """Fit the tiny module with QcommStrategy(**options) for ``epochs`` epochs, a checkpoint
    every epoch (from ``resume`` when given); return this rank's parameters, its qcomm stats
    before the strategy closed, the checkpoints written and what the logger wrote."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from qcomm.integrations.lightning import QcommStrategy

    seen: dict[str, Any] = {}

    class Grab(Callback):
        """The optimizer's stats at the end of fit, before teardown closes it; and whether the
        ranks held one model when validation ran."""

        def on_validation_start(self, trainer: Any, module: Any) -> None:
            seen.setdefault("val_params", []).append(flat_params(module))

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            opt = trainer.strategy.qcomm_optimizer
            seen.setdefault("inter", []).append(opt.stats()["bytes_sent"]["inter"])

        def on_train_end(self, trainer: Any, module: Any) -> None:
            opt = trainer.strategy.qcomm_optimizer
            seen["stats"] = opt.stats()
            seen["steps"] = trainer.global_step
            seen["lr"] = opt.param_groups[0]["lr"]
            seen["bar"] = dict(trainer.progress_bar_metrics)

    out = Path(root)
    with lightning_env(rank):
        module = make_module()
        ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1,
                               filename="{epoch}")
        t = trainer(QcommStrategy(**options), out, epochs, callbacks=[ckpt, Grab()],
                    enable_progress_bar=rank == 0)
        t.fit(module, train_dataloaders=loader(), val_dataloaders=loader(False),
              ckpt_path=resume)
    return {"params": flat_params(module), "val_params": seen.get("val_params", []),
            "stats": seen["stats"], "steps": seen["steps"], "lr": seen["lr"],
            "inter_by_step": seen["inter"], "bar": seen["bar"],
            "ckpts": sorted(p.name for p in (out / "ckpt").iterdir()),
            "metrics": ((out / "logs" / "version_0" / "metrics.csv").read_text()
                        if rank == 0 else None)}


def wrong_strategy_body(rank: int, world_size: int, root: str) -> str:
    """Lightning's own strategy="ddp" with an ASSGD from configure_optimizers: the error's
    type and message, on every rank."""
    from qcomm.sgd import ASSGD, SLOW_LINK

    with lightning_env(rank):
        module = make_module(lambda m: ASSGD(m.parameters(), lr=0.1, **SLOW_LINK,
                                             procs_per_node=2))
        t = trainer("ddp", Path(root), 1, logger=False, enable_checkpointing=False)
        try:
            t.fit(module, train_dataloaders=loader())
        except Exception as exc:  # the type and message are what the test checks
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def refused_optimizers_body(rank: int, world_size: int, root: str) -> list[str]:
    """configure_optimizers returning a qcomm optimizer, then two optimizers, then
    sync_batchnorm=True, under QcommStrategy: the errors, by type and message."""
    from qcomm.integrations.lightning import QcommStrategy
    from qcomm.sgd import ASSGD

    makers = [lambda m: ASSGD(m.parameters(), lr=0.1),
              lambda m: [torch.optim.SGD(m.net[0].parameters(), lr=0.1),
                         torch.optim.SGD(m.net[2].parameters(), lr=0.1)]]
    errors = []
    with lightning_env(rank):
        for make in makers:
            t = trainer(QcommStrategy(procs_per_node=2), Path(root), 1, logger=False,
                        enable_checkpointing=False)
            module = make_module(make)
            # Lightning itself refuses several optimizers in automatic optimization.
            module.automatic_optimization = False
            try:
                t.fit(module, train_dataloaders=loader())
                errors.append("no error")
            except Exception as exc:  # the type and message are what the test checks
                errors.append(f"{type(exc).__name__}: {exc}")
        t = trainer(QcommStrategy(procs_per_node=2), Path(root), 1, logger=False,
                    enable_checkpointing=False, sync_batchnorm=True)
        try:
            t.fit(make_module(), train_dataloaders=loader())
            errors.append("no error")
        except Exception as exc:  # the type and message are what the test checks
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def killed_node_body(rank: int, world_size: int, root: str, kill_at: int, steps: int,
                     options: dict[str, Any]) -> dict[str, Any]:
    """2 nodes of 1; node 1 is killed (SIGKILL) after step ``kill_at``; node 0 fits on to
    ``steps``. Returns node 0's steps, its stats and whether its parameters are finite."""
    import signal

    from lightning.pytorch.callbacks import Callback

    from qcomm.integrations.lightning import QcommStrategy

    seen: dict[str, Any] = {}

    class Kill(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if rank == 1 and trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            seen["stats"] = trainer.strategy.qcomm_optimizer.stats()
            seen["steps"] = trainer.global_step

    with lightning_env(rank):
        import lightning as L

        module = make_module()
        t = L.Trainer(accelerator="cpu", devices=2, strategy=QcommStrategy(**options),
                      max_steps=steps, default_root_dir=root, enable_model_summary=False,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      limit_val_batches=0, callbacks=[Kill()])
        t.fit(module, train_dataloaders=loader())
    return {"steps": seen["steps"], "stats": seen["stats"],
            "finite": bool(flat_params(module).isfinite().all())}


def foreign_checkpoints_body(rank: int, world_size: int, root: str, ckpt: str,
                             options: dict[str, Any]) -> list[str]:
    """Resume (to the epoch already done: nothing to train) from ``ckpt`` without its ranks'
    qcomm directory, then from a copy whose optimizer state is a plain torch one (as a DDP run
    writes): the first error, and what the optimizer holds after the second."""
    from qcomm.checkpoint.optimizer import STATE_KEY
    from qcomm.integrations.lightning import QcommStrategy

    out = Path(root)
    lone, plain = out / "lone.ckpt", out / "plain.ckpt"
    if rank == 0:
        state = torch.load(ckpt, weights_only=False)
        torch.save(state, lone)
        for opt_state in state["optimizer_states"]:
            opt_state.pop(STATE_KEY)
        torch.save(state, plain)
    torch.distributed.barrier()
    seen: list[str] = []
    with lightning_env(rank):
        for path in (lone, plain):
            strategy = QcommStrategy(**options)
            t = trainer(strategy, out, 1, logger=False, enable_checkpointing=False)
            try:
                t.fit(make_module(), train_dataloaders=loader(), ckpt_path=path)
                held = t.optimizers[0].state.values()
                seen.append(f"loaded: momentum buffers {sum('momentum_buffer' in v for v in held)}")
            except Exception as exc:  # the type and message are what the test checks
                seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def overflowing_adamw(rank: int, inf_at: Collection[int]) -> Callable[[Any], Any]:
    """A ``make_optimizer`` for :func:`make_module`: AdamW, and the module's loss on rank 1 Inf
    at the optimizer steps ``inf_at`` (Lightning counts them from 0), as a float16 overflow
    makes it."""

    def adamw(module: Any) -> Any:
        loss_of = module.training_step

        def training_step(batch: Any, batch_idx: int) -> torch.Tensor:
            loss = loss_of(batch, batch_idx)
            overflow = rank == 1 and module.trainer.global_step in inf_at
            return loss * float("inf") if overflow else loss

        module.training_step = training_step
        return torch.optim.AdamW(module.parameters(), lr=1e-2)

    return adamw


def overflow_body(rank: int, world_size: int, root: str, options: dict[str, Any],
                  inf_at: int) -> dict[str, Any]:
    """One epoch (8 steps) of the tiny module with AdamW in ``precision="16-mixed"`` (torch's
    GradScaler on CPU); at step ``inf_at`` rank 1's loss is Inf. Returns this rank's scale
    after each step, its qcomm stats and its parameters (or the error that ended the fit)."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    from qcomm.integrations.lightning import QcommStrategy

    seen: dict[str, Any] = {"scales": []}

    class Scales(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            seen["scales"].append(trainer.precision_plugin.scaler.get_scale())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            seen["stats"] = trainer.strategy.qcomm_optimizer.stats()

    with lightning_env(rank):
        module = make_module(overflowing_adamw(rank, (inf_at,)))
        strategy = QcommStrategy(**options, precision_plugin=MixedPrecision("16-mixed", "cpu"))
        t = trainer(strategy, Path(root), 1, logger=False, enable_checkpointing=False,
                    callbacks=[Scales()])
        try:
            t.fit(module, train_dataloaders=loader())
        except Exception as exc:  # the type and message are what the test checks
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"scales": seen["scales"], "stats": seen["stats"], "params": flat_params(module)}


def one_node_body(rank: int, world_size: int, root: str, qcomm: bool, fp16: bool,
                  trainer_kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch of the tiny module with AdamW (rank 1's loss Inf at step 3 with ``fp16``:
    ``precision="16-mixed"``, a GradScaler on CPU) under Lightning's own ``"ddp"`` or
    ``QcommStrategy`` with the 4 ranks as one node; this rank's parameters before and after
    ``fit``."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from qcomm.integrations.lightning import QcommStrategy

    plugin = {"precision_plugin": MixedPrecision("16-mixed", "cpu")} if fp16 else {}
    strategy = QcommStrategy(procs_per_node=4, **plugin) if qcomm else DDPStrategy(**plugin)
    with lightning_env(rank):
        module = make_module(overflowing_adamw(rank, (3,) if fp16 else ()))
        start = flat_params(module)
        t = trainer(strategy, Path(root) / f"rank{rank}", 1, logger=False,
                    enable_checkpointing=False, **trainer_kwargs)
        t.fit(module, train_dataloaders=loader())
    return start, flat_params(module)


def overflow_resume_body(rank: int, world_size: int, root: str, options: dict[str, Any],
                         resume: str | None) -> dict[str, Any]:
    """Two epochs (16 steps) of the tiny module with AdamW in ``precision="16-mixed"``, rank
    1's loss Inf at steps 3 and 11 (one in each epoch), a checkpoint every epoch (from
    ``resume`` when given). Returns this rank's parameters and final scale."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    from qcomm.integrations.lightning import QcommStrategy

    out = Path(root)
    with lightning_env(rank):
        module = make_module(overflowing_adamw(rank, (3, 11)))
        ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1,
                               filename="{epoch}")
        strategy = QcommStrategy(**options, precision_plugin=MixedPrecision("16-mixed", "cpu"))
        t = trainer(strategy, out, 2, logger=False, callbacks=[ckpt])
        t.fit(module, train_dataloaders=loader(), ckpt_path=resume)
    return {"params": flat_params(module), "scale": t.precision_plugin.scaler.get_scale()}
