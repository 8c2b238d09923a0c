"""Lightning's ``strategy="ddp"`` against ``QcommStrategy(**SLOW_LINK)`` on the same
LightningModule, and ``QcommStrategy`` against the same optimizer in a plain loop: the bytes that
cross between the nodes per step and the time of a step, on one machine (emulated nodes over
loopback, Gloo; no link is shaped, so the times are compute and Lightning's own overhead).

    python bench/lightning_cell.py                        # 2 nodes of 2, 48 steps, all three
    python bench/lightning_cell.py --methods qcomm,plain --steps 96
    python bench/lightning_cell.py --model charlm --methods qcomm,plain --repeats 3

DDP's bytes are measured by a comm hook that counts what each rank hands to the all-reduce
(``B`` per step, the fp32 gradient); whatever algorithm the all-reduce runs, each node must
receive the other node's dense sum, so at least ``2B`` cross between 2 nodes per step: the
figure reported, a lower bound in DDP's favour. qcomm's are its own counters, summed over ranks.
Needs the ``lightning`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, load_average, write_json

METHODS = ("ddp", "qcomm", "plain")
FEATURES, CLASSES, SAMPLES, BATCH = 40, 10, 8192, 32
CONTEXT = 64   # --model charlm: the cluster's charlm transformer, 64 characters a window


def _loss(net: Any, batch: Any, args: argparse.Namespace) -> Any:
    import torch

    if args.model == "charlm":
        from bench.cluster.charlm import lm_loss

        return lm_loss(net, batch[0])
    x, y = batch
    return torch.nn.functional.cross_entropy(net(x), y)


def _optimizer(params: Any, args: argparse.Namespace) -> Any:
    """The torch optimizer: SGD for the MLP, AdamW (the cluster workload's) for the
    transformer."""
    import torch

    if args.model == "charlm":
        return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _setting(args: argparse.Namespace) -> dict[str, Any]:
    """qcomm's setting for that optimizer: SLOW_LINK for SGD, ADAMW_SLOW_LINK for AdamW."""
    from qcomm.sgd import ADAMW_SLOW_LINK, SLOW_LINK

    return dict(ADAMW_SLOW_LINK if args.model == "charlm" else SLOW_LINK)


def _model(args: argparse.Namespace) -> Any:
    import torch

    torch.manual_seed(0)
    if args.model == "charlm":
        from bench.cluster.charlm import CharTransformer

        return CharTransformer(vocab=128, width=128, layers=6, heads=4, context=CONTEXT)
    hidden = args.hidden
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, CLASSES))


def _data(args: argparse.Namespace) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    if args.model == "charlm":   # random characters: the cost of a step, not what it learns
        return TensorDataset(torch.randint(0, 128, (SAMPLES, CONTEXT + 1), generator=g))
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, (x[:, :CLASSES] * 3).argmax(1))


def _count_hook(counted, bucket):  # type: ignore[no-untyped-def]
    """DDP's own fp32 all-reduce, counting the bytes this rank hands to it. (No annotations:
    DDP refuses a hook whose ``bucket`` is annotated other than ``dist.GradBucket``, and under
    ``from __future__ import annotations`` every annotation is a string.)"""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    counted[0] += buf.numel() * buf.element_size()
    return allreduce_hook(None, bucket)


def _lightning_rank(rank: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    import os

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from qcomm.integrations.lightning import QcommStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    counted, marks = [0], {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return _loss(self.net, batch, args)

        def configure_optimizers(self) -> Any:
            return _optimizer(self.parameters(), args)

    class Clock(Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            if method == "ddp":
                trainer.strategy.model.register_comm_hook(counted, _count_hook)

        def on_train_batch_start(self, trainer: Any, module: Any, *a: Any) -> None:
            if trainer.global_step == args.warmup:
                marks["start"] = time.perf_counter()
                marks["cpu_start"] = time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if trainer.global_step != args.steps:
                return
            marks["end"] = time.perf_counter()
            marks["cpu_end"] = time.process_time()
            if method == "ddp":
                marks["bytes"] = counted[0]
            else:
                # Every round of the run delivered (the wait-free sends finish in the
                # background), so the count does not depend on when it is read.
                opt = trainer.strategy.qcomm_optimizer
                opt.flush()
                marks["bytes"] = opt.stats()["bytes_sent"]["inter"]

    strategy = ("ddp" if method == "ddp"
                else QcommStrategy(**_setting(args), procs_per_node=args.procs_per_node))
    trainer = L.Trainer(accelerator="cpu", devices=args.nodes * args.procs_per_node,
                        strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.out,
                        callbacks=[Clock()])
    trainer.fit(Module(), DataLoader(_data(args), batch_size=_batch(args), shuffle=True))
    return marks


def _plain_rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler

    from qcomm.sgd import HierarchicalOptimizer

    model = _model(args)
    opt = HierarchicalOptimizer(_optimizer(model.parameters(), args), **_setting(args),
                                procs_per_node=args.procs_per_node)
    net = opt.data_parallel(model)
    data = _data(args)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=_batch(args), sampler=sampler)
    marks: dict[str, Any] = {}
    for step, batch in enumerate(_batches(loader, sampler)):
        if step == args.warmup:
            marks["start"] = time.perf_counter()
            marks["cpu_start"] = time.process_time()
        opt.zero_grad()
        _loss(net, batch, args).backward()
        opt.step()
        if step + 1 == args.steps:
            marks["end"] = time.perf_counter()
            marks["cpu_end"] = time.process_time()
            opt.flush()
            marks["bytes"] = opt.stats()["bytes_sent"]["inter"]
            break
    opt.close()
    return marks


def _batch(args: argparse.Namespace) -> int:
    """Samples per rank and step: the cluster workload's (8 windows for the transformer)."""
    return 8 if args.model == "charlm" else BATCH


def _batches(loader: Any, sampler: Any) -> Any:
    """The loader's batches, epoch after epoch (as Lightning's loop runs to ``max_steps``)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _rank(rank: int, world_size: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    if method == "plain":
        return _plain_rank(rank, args)
    return _lightning_rank(rank, method, args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every method in a fresh world of its own; one row per method."""
    from qcomm.testing.multiprocess import run_world

    params = sum(p.numel() for p in _model(args).parameters())
    rows, world = [], args.nodes * args.procs_per_node
    for method in args.methods:
        load = load_average()
        marks = run_world(_rank, world, args=(method, args), timeout_s=args.timeout)
        # Bytes over the whole run (every step), time over the steps after the warm-up.
        steps, timed = args.steps, args.steps - args.warmup
        sent = sum(m["bytes"] for m in marks)
        # DDP: every rank hands B to the all-reduce; at least 2B cross the cut between nodes.
        between = 2 * marks[0]["bytes"] / steps if method == "ddp" else sent / steps
        step_ms = statistics.median((m["end"] - m["start"]) / timed * 1e3 for m in marks)
        # CPU time of the process (all its threads) per step: what a step costs, whatever
        # else the machine runs (wall time on a loaded machine is mostly waiting for a core).
        cpu_ms = statistics.median((m["cpu_end"] - m["cpu_start"]) / timed * 1e3
                                   for m in marks)
        rows.append({"method": method, "params": params, "steps": steps, "steps_timed": timed,
                     "bytes_between_nodes_per_step": between, "step_ms": step_ms,
                     "cpu_ms_per_step": cpu_ms, "load_average_before": load})
        print(f"{method}: {between:,.0f} bytes between nodes per step, {step_ms:.1f} ms a step, "
              f"{cpu_ms:.1f} ms of CPU a step", flush=True)
    return {"nodes": args.nodes, "procs_per_node": args.procs_per_node, "model": args.model,
            "hidden": args.hidden, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default all)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--steps", type=int, default=48, help="steps per rank (default 48)")
    p.add_argument("--warmup", type=int, default=8,
                   help="first steps left out of the step time (default 8)")
    p.add_argument("--hidden", type=int, default=384,
                   help="width of the MLP's two hidden layers (default 384: 167,434 parameters)")
    p.add_argument("--model", choices=("mlp", "charlm"), default="mlp",
                   help="mlp (SGD, SLOW_LINK; default) or charlm: the cluster's 1.23M-parameter "
                        "transformer on random characters, batch 8 (AdamW, ADAMW_SLOW_LINK)")
    p.add_argument("--repeats", type=int, default=1,
                   help="the methods run this many times, interleaved (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per method before its world is killed (default 600)")
    p.add_argument("--out", default="bench/out", help="Lightning's root directory")
    p.add_argument("--json", default="bench/out/lightning_cell.json", help="where to write")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; allowed: {', '.join(METHODS)}")
    if args.repeats < 1:
        p.error(f"--repeats must be 1 or more, got {args.repeats}")
    args.methods = args.methods * args.repeats   # interleaved: every method, then again
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must lie in [0, --steps), got {args.warmup}")
    result = run(args)
    print(format_table(["method", "bytes between nodes / step", "ms / step", "CPU ms / step"],
                       [[r["method"], round(r["bytes_between_nodes_per_step"]),
                         round(r["step_ms"], 1), round(r["cpu_ms_per_step"], 1)]
                        for r in result["rows"]]))
    write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
