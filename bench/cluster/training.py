"""What every method of the cluster benchmark gets, and what its builder gives back.

- :class:`Layout`: the cluster's shape (nodes x ranks per node);
- :class:`Config`: the settings every method gets, identical across methods;
- :class:`Built`: a method ready to train (the module to call, the optimizer, the hooks the
  workload needs around the timed window);
- :func:`inner_optimizer`: the workload's optimizer, which every method trains with;
- :func:`average_all`: the mean of every rank's parameters (a final model).

Its own module, imported by methods.py (the registry and the torch and qcomm builders) and by
torchft_methods.py (torchft's builders), which methods.py imports when such a method runs: the
two import this, not each other. Pure Python until a function runs (torch is imported there),
like methods.py's registry.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Layout:
    """``nodes`` nodes with ``procs`` ranks each; ranks are node-major (torchrun's order)."""

    nodes: int
    procs: int

    @property
    def world(self) -> int:
        return self.nodes * self.procs

    @property
    def tag(self) -> str:
        """``"2x2"``: how command lines and tables name the layout."""
        return f"{self.nodes}x{self.procs}"


@dataclass
class Config:
    """What every method gets, identical across methods.

    ``optimizer`` is the workload's: ``"sgd"`` (lr, momentum) or ``"adamw"`` (lr, betas
    0.9/0.95, weight_decay). DiLoCo: ``diloco_sync_every`` inner steps per round (streaming:
    each fragment once per round), ``streaming_fragments`` and ``streaming_delay`` (torchft's
    ``fragment_sync_delay``: inner steps the allreduce of a fragment overlaps). ``fsdp``: the
    model is sharded by FSDP2 inside each node (sharding.py; the methods with a sharded form).
    ``total_steps``: the run's length in steps (``--warmup + --steps``), which the README's
    settings are given as users are told to (``total_steps=``).
    """

    lr: float
    momentum: float
    layout: Layout
    seed: int = 0
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    powersgd_rank: int = 4
    localsgd_period: int = 8
    localsgd_warmup: int = 0
    hook_bits: int = 4
    hook_rail: str = "auto"
    hook_rounding: str | None = None
    hook_bucket_mb: float | None = None
    hook_ddp_bucket_mb: float | None = None
    diloco_sync_every: int = 16
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    streaming_fragments: int = 4
    streaming_delay: int = 1
    pg_timeout: float = 300.0
    fsdp: bool = False
    total_steps: int | None = None


@dataclass
class Built:
    """A method ready to train.

    Attributes:
        model: what the training loop calls (DDP-wrapped or the bare module).
        module: the bare module (evaluated, snapshotted).
        optimizer: stepped once per training step.
        flush: completes traffic in flight (before the byte counters are read).
        finalize: makes the final model (e.g. averages parameters over all ranks); collective.
        comm_stats: qcomm's ``{"intra": bytes, "inter": bytes}`` sent by this rank so far, or
            None for methods without qcomm stats.
        close: releases resources.
        context: entered around the training loop (warm-up and timed steps), left before
            ``finalize`` (torchft's DiLoCo is such a context manager).
        node_any: ``node_any(flag)``: True when ``flag`` holds on any rank of this node
            (collective over the node); how a per-node time budget ends on one step for the
            node's ranks. None for methods whose ranks all take the same steps.
        live_nodes: how many nodes the method still trains with (qcomm's
            ``stats()["live_nodes"]`` where it reports one), or None.
        pace: the wait-free gossip's pace per rank, recorded as they are: ``terms_paired``
            and ``mix_lag_rounds`` of qcomm's ``stats()``; None for other methods.
        sharded: the module's parameters are FSDP2 shards (``--fsdp``): its snapshots and
            final model are gathered whole by every rank of the node together.
    """

    model: Any
    module: Any
    optimizer: Any
    flush: Callable[[], None] = lambda: None
    finalize: Callable[[], None] = lambda: None
    comm_stats: Callable[[], dict[str, int] | None] = lambda: None
    close: Callable[[], None] = lambda: None
    notes: dict[str, Any] = field(default_factory=dict)
    context: AbstractContextManager = field(default_factory=nullcontext)
    node_any: Callable[[bool], bool] | None = None
    live_nodes: Callable[[], int | None] = lambda: None
    pace: Callable[[], dict[str, Any] | None] = lambda: None
    sharded: bool = False


OPTIMIZERS = ("sgd", "adamw")


def inner_optimizer(params, cfg: Config):
    """The workload's optimizer over ``params``: SGD + momentum, or AdamW with the betas of
    GPT-style training (0.9, 0.95) and decoupled weight decay."""
    import torch

    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                 weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")


LR_SCHEDULES = ("constant", "cosine")
# The cosine schedule's linear warm-up: this fraction of the run's steps.
WARMUP_FRACTION = 0.05


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The learning rate's multiplier at ``step`` (0-based) of a run of ``total`` steps:
    ``constant`` 1; ``cosine`` a linear warm-up over the first 5% of the steps, then a cosine
    from 1 to 0 at ``total`` (what torch's ``LinearLR`` then ``CosineAnnealingLR`` give);
    steps past ``total`` (a slower node's, under a time budget) stay at 0.

    Raises:
        ValueError: an unknown ``schedule`` or ``total`` < 1.
    """
    import math

    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if total < 1:
        raise ValueError(f"total must be >= 1 step, got {total}")
    if schedule == "constant":
        return 1.0
    warm = max(1, round(WARMUP_FRACTION * total))
    if step < warm:
        return (step + 1) / warm
    done = min(1.0, (step - warm) / max(1, total - warm))
    return 0.5 * (1.0 + math.cos(math.pi * done))


def scheduled(optimizer, schedule: str, total: int, lr: float) -> Callable[[int], None]:
    """A function ``at(step)`` that sets every param group's learning rate of ``optimizer`` to
    ``lr`` times :func:`lr_factor` at ``step``: what a training loop calls before each
    ``optimizer.step()``. By the step's index rather than by counting calls, so a worker
    started again from a checkpoint (whose param groups hold the lr of its step) takes the
    run's schedule."""
    lr_factor(schedule, 0, total)   # an unknown schedule fails here, before training

    def at(step: int) -> None:
        now = lr * lr_factor(schedule, step, total)
        for g in optimizer.param_groups:
            g["lr"] = now

    return at


def average_all(module) -> None:
    """Every rank's parameters <- the mean over all ranks (one allreduce per tensor)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        w = dist.get_world_size()
        for p in module.parameters():
            dist.all_reduce(p.data)
            p.data.div_(w)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/training.py is a library of the cluster benchmark (what every method "
        "gets: layout, settings, the built method, the workload's optimizer), imported by "
        "methods.py and torchft_methods.py; it runs nothing. See bench/cluster/README.md."
    )
