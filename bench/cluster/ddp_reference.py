"""What fp32 DDP computes, in one process: the learning curve that picks a workload's target.

DDP's step is the optimizer step on the mean of the ranks' gradients; with equal batches that is
the gradient of the mean loss over all ranks' batches together. This script draws exactly the
batches ranks 0..W-1 draw in workload.py (same seed rule), concatenates them, and takes one
optimizer step per training step, printing the held-out quality every ``--every`` steps. No
network, no root, one CPU thread:

    python bench/cluster/ddp_reference.py --workload charlm --ranks 4

The charlm target (workloads.py) is the validation loss this curve reaches at about 70% of the
step budget; bench/cluster/README.md records the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import training as T
from bench.cluster import worker_flags as F
from bench.cluster import workloads as W


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--workload", default="charlm", choices=list(W.WORKLOADS),
                   help="The workload whose DDP curve to compute.")
    p.add_argument("--ranks", type=int, default=4,
                   help="Ranks of the DDP job it stands for (4: the 2x2 and 4x1 layouts).")
    # workload.py's flags: the same batches and model as its ranks (declared in worker_flags.py)
    F.add_flags(p, ("steps", "lr_schedule", "warmup"))
    p.add_argument("--every", type=int, default=25,
                   help="Steps between evaluations (the printed step counts from the timed "
                        "window's start).")
    F.add_flags(p, ("lr", "seed", "heads", "context", "eval_windows"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    info = W.WORKLOADS[args.workload]
    steps = (args.steps or info.steps) + args.warmup
    for key in ("width", "depth", "batch", "momentum", "weight_decay"):
        setattr(args, key, getattr(info, key))
    args.lr = info.lr if args.lr is None else args.lr
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / f"{args.workload}.npz"
        W.make_data(args.workload, data, seed=args.seed)
        works = [W.load(args.workload, data, rank=r, seed=args.seed, batch=args.batch,
                        total_steps=steps, args=args) for r in range(args.ranks)]
    torch.manual_seed(args.seed)  # workload.py's initial weights
    model = works[0].make_model()
    cfg = T.Config(lr=args.lr, momentum=args.momentum, layout=T.Layout(1, 1),
                   optimizer=info.optimizer, weight_decay=args.weight_decay)
    opt = T.inner_optimizer(model.parameters(), cfg)
    lr_at = T.scheduled(opt, args.lr_schedule, steps, args.lr)
    print(f"{args.workload}: {args.ranks} ranks x batch {args.batch}, lr {args.lr} "
          f"{args.lr_schedule}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    print(f"window step  {info.metric}  seconds")
    t0 = time.perf_counter()
    for i in range(steps):
        # mean over ranks of each rank's mean loss = DDP's averaged gradient
        loss = sum(w.loss(model, i) for w in works) / args.ranks
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lr_at(i)
        opt.step()
        s = i + 1 - args.warmup
        if s > 0 and (s % args.every == 0 or i + 1 == steps):
            print(f"{s:11d}  {works[0].evaluate(model):.4f}  {time.perf_counter() - t0:.0f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
