"""qcomm versus synchronous fp32 training on MNIST-1D, 2 emulated nodes x 2 processes over Gloo,
with SGD (ASSGD) and with AdamW (HierarchicalOptimizer around torch.optim.AdamW).

    python examples/train_mnist1d.py [--epochs 60] [--bits 4] [--lr 0.2] [--batch-size 32]
                                     [--optimizers sgd,adamw] [--adamw-lr 0.003]

Starts 4 local processes (ranks 0-1 are node 0, ranks 2-3 node 1), generates MNIST-1D locally
(``mnist1d.data.make_dataset``; nothing is downloaded), and trains the same small 1-D CNN twice,
from the same seed, with the same data order, epochs and hyperparameters:

* ASSGD: gradients averaged inside each node in fp32, local SGD step, then asynchronous CHOCO
  gossip of ``--bits``-bit parameter differences between the nodes (sharded over the two local
  ranks, so each "NIC" carries half);
* synchronous fp32 SGD: ``HierarchicalAllreduce`` of the gradients at full precision
  (intra-node reduce-scatter, rail allreduce of each local rank's shard between nodes,
  intra-node all-gather), then ``torch.optim.SGD``;
* the same pair with AdamW: ``HierarchicalOptimizer(torch.optim.AdamW(...))`` (the same
  communication as ASSGD around AdamW's own update) against synchronous fp32 AdamW.

Prints the final test accuracy (ASSGD: of the exact global average of the nodes' parameters,
and of node 0's own parameters) and the bytes that crossed between nodes, summed over ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mnist1d_model import ConvNet, accuracy, make_mnist1d

from qcomm.collectives.hierarchical import HierarchicalAllreduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.sgd import ASSGD, HierarchicalOptimizer
from qcomm.testing.multiprocess import run_world


@dataclass(frozen=True)
class Config:
    nodes: int = 2
    procs_per_node: int = 2
    epochs: int = 60
    batch_size: int = 32          # per rank
    lr: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 0.0
    bits: int = 4
    staleness: int = 1
    seed: int = 0
    num_samples: int = 5000
    optimizers: str = "sgd,adamw"   # which pairs to run
    adamw_lr: float = 0.003
    adamw_weight_decay: float = 0.01

    def pairs(self) -> list[tuple[str, str]]:
        """(qcomm method, synchronous baseline) per optimizer asked for."""
        table = {"sgd": ("assgd", "sgd"), "adamw": ("adamw-qcomm", "adamw")}
        names = [n.strip() for n in self.optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in table]
        if unknown or not names:
            raise ValueError(f"optimizers must be a comma list of {sorted(table)}, "
                             f"got {self.optimizers!r}")
        return [table[n] for n in names]


def _batches(n: int, epoch: int, cfg: Config, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's mini-batches of one epoch: a seeded permutation dealt round-robin."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    mine = perm[rank::world]
    steps = len(mine) // cfg.batch_size
    return [mine[i * cfg.batch_size:(i + 1) * cfg.batch_size] for i in range(steps)]


def _train(method: str, rank: int, world: int, cfg: Config, data: dict) -> dict:
    torch.manual_seed(cfg.seed)
    model = ConvNet()
    comm = dict(bits=cfg.bits, staleness=cfg.staleness, procs_per_node=cfg.procs_per_node,
                seed=cfg.seed)
    stats = CommStats()
    averager = None
    qcomm_method = method in ("assgd", "adamw-qcomm")
    if method.startswith("adamw"):
        max_lr = cfg.adamw_lr
        opt = torch.optim.AdamW(model.parameters(), lr=max_lr,
                                weight_decay=cfg.adamw_weight_decay)
        if qcomm_method:
            opt = HierarchicalOptimizer(opt, **comm)
    else:
        max_lr = cfg.lr
        hp = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        opt = (ASSGD(model.parameters(), **hp, **comm) if qcomm_method
               else torch.optim.SGD(model.parameters(), **hp))
    if not qcomm_method:
        averager = HierarchicalAllreduce(Topology(cfg.procs_per_node), spec=None, stats=stats)
    steps_per_epoch = len(_batches(len(data["y"]), 0, cfg, rank, world))
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=max_lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.15)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.epochs * steps_per_epoch, desc=f"{method:>11}", unit="step",
                   dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        for idx in _batches(len(data["y"]), epoch, cfg, rank, world):
            loss = torch.nn.functional.cross_entropy(model(data["x"][idx]), data["y"][idx])
            opt.zero_grad()
            loss.backward()
            if averager is not None:
                averager.mean_([p.grad for p in model.parameters()])
            opt.step()
            sched.step()
            if bar is not None:
                bar.update(1)
                if bar.n % 20 == 0:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
    result: dict = {}
    if qcomm_method:
        st = opt.stats(consensus=True)
        result["own_acc"] = accuracy(model, data["x_test"], data["y_test"])
        result["consensus_distance"] = st["consensus_distance"]
        opt.average_parameters()
        result["bytes"] = st["bytes_sent"]
        opt.close()
    else:
        result["bytes"] = stats.snapshot()["bytes_sent"]
    dist.barrier()
    result["seconds"] = time.perf_counter() - start
    if bar is not None:
        bar.close()
    result["acc"] = accuracy(model, data["x_test"], data["y_test"])
    return result


def _worker(rank: int, world: int, cfg: Config, data: dict) -> dict:
    return {m: _train(m, rank, world, cfg, data) for pair in cfg.pairs() for m in pair}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    for field, value in asdict(defaults).items():
        ap.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="kill the 4 processes past this many seconds")
    args = ap.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(defaults)})
    cfg.pairs()  # a bad --optimizers fails here, before any process starts
    world = cfg.nodes * cfg.procs_per_node
    t0 = time.perf_counter()
    data = make_mnist1d(cfg.num_samples, seed=42)
    print(f"MNIST-1D: {len(data['y'])} train / {len(data['y_test'])} test samples; "
          f"{cfg.nodes} nodes x {cfg.procs_per_node} processes (Gloo); {cfg}", flush=True)
    results = run_world(_worker, world, args=(cfg, data), timeout_s=args.timeout_s,
                        pg_timeout_s=args.timeout_s)
    wall = time.perf_counter() - t0

    def inter(method: str) -> int:
        return sum(r[method]["bytes"]["inter"] for r in results)

    labels = {"assgd": "ASSGD", "sgd": "synchronous fp32 SGD",
              "adamw-qcomm": "qcomm AdamW", "adamw": "synchronous fp32 AdamW"}
    print(f"\n{'method':<40} {'test acc':>9} {'inter-node bytes':>17} {'train s':>8}")
    ok = True
    for ours, base in cfg.pairs():
        a, s = results[0][ours], results[0][base]
        print(f"{labels[ours] + f' {cfg.bits}-bit gossip (global average)':<40} "
              f"{a['acc']:>8.1f}% {inter(ours):>17,} {a['seconds']:>8.1f}")
        print(f"{'  node 0 own parameters':<40} {a['own_acc']:>8.1f}%")
        print(f"{labels[base]:<40} {s['acc']:>8.1f}% {inter(base):>17,} {s['seconds']:>8.1f}")
        ratio = inter(base) / max(1, inter(ours))
        # Consensus distance: how far the nodes' parameters are from their mean
        # (sqrt(mean over nodes of ||x_node - mean||^2)); 0 means every node holds the mean.
        print(f"  accuracy gap ({labels[base]} - {labels[ours]}): {s['acc'] - a['acc']:+.1f} "
              f"points; inter-node bytes {ratio:.1f}x fewer; consensus distance at the end "
              f"{a['consensus_distance']:.2e}\n")
        ok = ok and math.isfinite(a["acc"])
    print(f"wall time {wall:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
