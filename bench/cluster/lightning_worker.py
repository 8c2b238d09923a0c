"""One rank of the cluster benchmark under Lightning: the workload's model, data, optimizer and
step budget of workload.py, trained by ``lightning.Trainer.fit`` with ``strategy="ddp"``
(``--method lightning-ddp``) or ``QcommStrategy`` with the options of a qcomm method
(``--method lightning-adamw-slow-link``: the ``adamw-slow-link`` run of workload.py, under
Lightning).

The same steps as workload.py (compute-only baseline, ``--warmup`` untimed steps, the timed
window with its snapshots and byte counters, the final model evaluated by rank 0) and the same
JSON, so compare.py runs it as one more method: ``compare.py --methods
adamw-slow-link,lightning-adamw-slow-link,lightning-ddp``. Each Lightning step is timed from the
end of the one before, so the loop's own work between steps counts. Healthy runs only: no lost
node, no time budget, no FSDP, a constant learning rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    # torchrun runs this file by path (netns.sh): the repository root first on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import training as T
from bench.cluster import workload as WL
from bench.cluster import workloads as W
from bench.cluster.link_counters import read_iface_bytes, read_tcp_retransmits
from bench.cluster.rank_place import Place
from bench.cluster.run_record import rank_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """workload.py's command line, for a Lightning method and a healthy run."""
    args = WL.parse_args(argv)
    if not M.is_lightning(args.method):
        raise SystemExit(f"lightning_worker.py: --method must be a Lightning method "
                         f"(lightning-ddp, lightning-<qcomm method>), got {args.method!r}")
    unsupported = [flag for flag, on in (
        ("--time-budget", args.time_budget is not None), ("--until-fastest", args.until_fastest),
        ("--kill-node", args.kill_node is not None), ("--join-at", args.join_at is not None),
        ("--fsdp", args.fsdp), ("--lr-schedule", args.lr_schedule != "constant"),
        ("--profile", getattr(args, "profile", False))) if on]
    if unsupported:
        raise SystemExit(f"lightning_worker.py runs healthy, fixed-step runs with a constant "
                         f"learning rate: {', '.join(unsupported)} not supported")
    return args


def make_strategy(method: str, cfg: T.Config) -> Any:
    """``"ddp"``, or ``QcommStrategy`` with the options workload.py's builder gives the same
    qcomm method (ring, staleness 1, the run's seed and length)."""
    base = M.lightning_base(method)
    if base == "ddp":
        return "ddp"
    from qcomm.integrations.lightning import QcommStrategy

    opts = M.qcomm_variant(base)
    if opts is None or opts.pop("kind") != "qcomm-hier" or not opts.pop("ddp"):
        raise SystemExit(f"--method {method}: Lightning runs ddp or a qcomm-hier method whose "
                         f"node mean is DDP's (a name ending in -ddp, or adamw-slow-link)")
    if opts.pop("named", False):
        opts["total_steps"] = cfg.total_steps
    return QcommStrategy(graph="ring", staleness=1, seed=cfg.seed, procs_per_node=cfg.layout.procs,
                         **opts)


def _readings(here: Place, strategy: Any) -> tuple[Any, Any, dict[str, int] | None]:
    """The byte counters (link_counters.Readings): the node's by its local rank 0, qcomm's."""
    node = here.local_rank == 0 and here.layout.nodes > 1
    counters = read_iface_bytes(here.iface) if node else None
    retrans = read_tcp_retransmits() if node else None
    opt = getattr(strategy, "qcomm_optimizer", None)
    return counters, retrans, None if opt is None else dict(opt.stats()["bytes_sent"])


def _flush(strategy: Any) -> None:
    """The gossip rounds in flight completed (collective), so the counters see them."""
    opt = getattr(strategy, "qcomm_optimizer", None)
    if opt is not None:
        opt.flush()


def window_callback(args: argparse.Namespace, here: Place, net: torch.nn.Module) -> Any:
    """The timed window as a Lightning callback (its state in ``.rec``)."""
    import lightning.pytorch as pl

    snap_steps = {round(k * args.steps / args.snapshots) for k in range(1, args.snapshots + 1)}
    report_every = max(1, args.steps // 50)

    class Window(pl.Callback):
        def __init__(self) -> None:
            self.rec = SimpleNamespace(step_times=[], fwd_bwd=[], opt_times=[], snapshots=[],
                                       t_open=None, t_loop=None, t_window=None, start=None,
                                       end=None, t_prev=None, t_fwd=None, t_bwd=None)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i == args.warmup:   # the window opens: traffic completed, barrier, counters
                _flush(trainer.strategy)
                dist.barrier()
                self.rec.start = _readings(here, trainer.strategy)
                self.rec.t_open = self.rec.t_prev = time.perf_counter()
            self.rec.t_fwd = time.perf_counter()

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.rec.t_bwd = time.perf_counter()   # forward and backward done, step next

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any,
                               i: int) -> None:
            if i < args.warmup:
                return
            now, rec, k = time.perf_counter(), self.rec, i - args.warmup + 1
            rec.step_times.append(now - rec.t_prev)
            rec.fwd_bwd.append(rec.t_bwd - rec.t_fwd)
            rec.opt_times.append(now - rec.t_bwd)
            rec.t_prev = now
            if k in snap_steps and here.keeps_snapshots:
                rec.snapshots.append((k, now - rec.t_open,
                                      {n: v.clone() for n, v in net.state_dict().items()}))
            if here.rank == 0 and (k % report_every == 0 or k == args.steps):
                print(f"QCB_PROGRESS {k} {args.steps}", flush=True)
            if k == args.steps:   # the window closes: traffic completed, barrier, counters
                rec.t_loop = time.perf_counter() - rec.t_open
                _flush(trainer.strategy)
                dist.barrier()
                rec.end = _readings(here, trainer.strategy)
                rec.t_window = time.perf_counter() - rec.t_open

    return Window()


def lightning_module(work: W.Workload, net: torch.nn.Module, cfg: T.Config) -> Any:
    """The workload as a LightningModule: batch ``i`` is the index of this rank's ``i``-th
    batch (the workload draws every rank's batches itself, as in workload.py)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, i: Any, batch_idx: int) -> torch.Tensor:
            return work.loss(self.net, int(i))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return T.inner_optimizer(self.net.parameters(), cfg)

    return Module()


def fit(args: argparse.Namespace, here: Place, work: W.Workload, net: torch.nn.Module,
        cfg: T.Config) -> SimpleNamespace:
    """Lightning's fit of ``--warmup + --steps`` steps; the window's record."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    window = window_callback(args, here, net)
    trainer = pl.Trainer(accelerator="cpu", num_nodes=here.layout.nodes,
                         devices=here.layout.procs, strategy=make_strategy(args.method, cfg),
                         max_steps=args.warmup + args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         default_root_dir=f"{args.out}.lightning", callbacks=[window])
    indices = DataLoader(range(args.warmup + args.steps), batch_size=None)
    trainer.fit(lightning_module(work, net, cfg), indices)
    return window.rec


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)   # as workload.py: several ranks per 2-core machine
    here, _ = WL.join_job(args)
    total = args.warmup + args.steps
    work = W.load(args.workload, Path(args.data), rank=here.rank, seed=args.seed,
                  batch=args.batch, total_steps=total, args=args)
    cfg = WL.method_config(args, here.layout, work.info.optimizer)
    torch.manual_seed(args.seed)   # the same initial weights as every workload.py method
    net = work.make_model()
    model = (sum(p.numel() for p in net.parameters()), [list(p.shape) for p in net.parameters()])
    base_times = WL.baseline(work, net, cfg, args.baseline_steps, total)
    rec = fit(args, here, work, net, cfg)   # QcommStrategy averages the ranks at its end
    snap_file = Path(f"{args.out}.node{here.node}.snapshots")
    if here.keeps_snapshots:
        torch.save(rec.snapshots, snap_file)
    dist.barrier()
    def pair(j: int) -> tuple | None:   # (window opened, window closed), or None
        return None if rec.start[j] is None else (rec.start[j], rec.end[j])

    mine = rank_record(here.rank, here.node, here.local_rank, args.steps, rec.step_times,
                       rec.fwd_bwd, rec.opt_times, base_times, rec.t_loop, rec.t_window,
                       pair(0), pair(1), pair(2))
    gathered: list[Any] | None = [None] * here.world if here.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    dist.barrier()
    if here.rank == 0:
        built = SimpleNamespace(module=net, notes={"lightning": True})
        WL.write_result(args, work, built, here, gathered, model)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # as workload.py: every rank is past the last collective


if __name__ == "__main__":
    main()
