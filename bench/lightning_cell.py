"""Lightning's ``strategy="ddp"`` against ``QcommStrategy(**SLOW_LINK)`` on the same
LightningModule, and ``QcommStrategy`` against the same optimizer in a plain loop: the bytes that
cross between the nodes per step and the time of a step, on one machine (emulated nodes over
loopback, Gloo; no link is shaped, so the times are compute and Lightning's own overhead).

    python bench/lightning_cell.py                        # 2 nodes of 2, 48 steps, all three
    python bench/lightning_cell.py --methods qcomm,plain --steps 96

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


def _model(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, CLASSES))


def _data() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
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
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from qcomm.integrations.lightning import QcommStrategy
    from qcomm.sgd import SLOW_LINK

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    counted, marks = [0], {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(args.hidden)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Clock(Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            if method == "ddp":
                trainer.strategy.model.register_comm_hook(counted, _count_hook)

        def on_train_batch_start(self, trainer: Any, module: Any, *a: Any) -> None:
            if trainer.global_step == args.warmup:
                marks["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if trainer.global_step != args.steps:
                return
            marks["end"] = time.perf_counter()
            if method == "ddp":
                marks["bytes"] = counted[0]
            else:
                # Every round of the run delivered (the wait-free sends finish in the
                # background), so the count does not depend on when it is read.
                opt = trainer.strategy.qcomm_optimizer
                opt.flush()
                marks["bytes"] = opt.stats()["bytes_sent"]["inter"]

    strategy = ("ddp" if method == "ddp"
                else QcommStrategy(**SLOW_LINK, procs_per_node=args.procs_per_node))
    trainer = L.Trainer(accelerator="cpu", devices=args.nodes * args.procs_per_node,
                        strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.out,
                        callbacks=[Clock()])
    trainer.fit(Module(), DataLoader(_data(), batch_size=BATCH, shuffle=True))
    return marks


def _plain_rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from qcomm.sgd import SLOW_LINK, HierarchicalOptimizer

    model = _model(args.hidden)
    opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                **SLOW_LINK, procs_per_node=args.procs_per_node)
    net = opt.data_parallel(model)
    data = _data()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    marks: dict[str, Any] = {}
    for step, (x, y) in enumerate(_batches(loader, sampler)):
        if step == args.warmup:
            marks["start"] = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if step + 1 == args.steps:
            marks["end"] = time.perf_counter()
            opt.flush()
            marks["bytes"] = opt.stats()["bytes_sent"]["inter"]
            break
    opt.close()
    return marks


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

    params = sum(p.numel() for p in _model(args.hidden).parameters())
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
        rows.append({"method": method, "params": params, "steps": steps, "steps_timed": timed,
                     "bytes_between_nodes_per_step": between, "step_ms": step_ms,
                     "load_average_before": load})
        print(f"{method}: {between:,.0f} bytes between nodes per step, {step_ms:.1f} ms a step",
              flush=True)
    return {"nodes": args.nodes, "procs_per_node": args.procs_per_node, "hidden": args.hidden,
            "rows": rows}


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
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per method before its world is killed (default 600)")
    p.add_argument("--out", default="bench/out", help="Lightning's root directory")
    p.add_argument("--json", default="bench/out/lightning_cell.json", help="where to write")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; allowed: {', '.join(METHODS)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must lie in [0, --steps), got {args.warmup}")
    result = run(args)
    print(format_table(["method", "bytes between nodes / step", "ms / step"],
                       [[r["method"], round(r["bytes_between_nodes_per_step"]),
                         round(r["step_ms"], 1)] for r in result["rows"]]))
    write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
