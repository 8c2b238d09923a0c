"""Mid-run evaluation on one node: its own BatchNorm statistics, or the nodes' mean?

    python bench/buffers_midrun.py                       # 4 nodes x 1 rank, 3 seeds
    python bench/buffers_midrun.py --steps 300 --seeds 1 --every 50

Between two ``average_parameters()`` calls each node keeps its own buffers (BatchNorm's running
statistics). The alternative would be to gossip them too. This measures what that could gain at
best: ``--nodes`` processes (one rank per node, Gloo on this machine) train the MNIST-1D CNN
with BatchNorm (bench/cluster's ``mnist1d-bn`` workload) with ASSGD and the given gossip
settings, each rank on its own batches, and snapshot their state every ``--every`` steps.
Afterwards every snapshot is evaluated on the test set three ways, per node:

- ``own``: the node's parameters and its own buffers (what a node evaluates mid-run today);
- ``mean buffers``: the node's parameters with the nodes' exact mean buffers (the best any
  gossip of the buffers could give: an exact average, free);
- ``mean all``: the nodes' mean parameters and mean buffers (what ``average_parameters()``
  gives).

Printed: per step, the test accuracy of each way, averaged over the nodes, median over seeds,
and the largest gap between ``own`` and ``mean buffers`` over the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def _train(rank: int, world: int, data: str, seed: int, steps: int, every: int,
           comm: dict) -> list[dict]:
    import torch

    from bench.cluster import workloads as W
    from qcomm.sgd import ASSGD

    torch.set_num_threads(1)
    info = W.WORKLOADS["mnist1d-bn"]
    work = W.load("mnist1d-bn", Path(data), rank=rank, seed=seed, batch=info.batch,
                  total_steps=steps, args=SimpleNamespace(width=info.width, depth=info.depth))
    torch.manual_seed(seed)
    model = work.make_model()
    opt = ASSGD(model.parameters(), lr=info.lr, momentum=info.momentum, procs_per_node=1,
                seed=seed, **comm)
    opt.attach(model)
    snaps = []
    for i in range(steps):
        opt.zero_grad()
        work.loss(model, i).backward()
        opt.step()
        if (i + 1) % every == 0:
            snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    opt.close()
    return snaps


def _mean(states: list[dict], keys: list[str]) -> dict:
    import torch

    return {k: (torch.stack([s[k].double() for s in states]).mean(0).to(states[0][k].dtype)
                if states[0][k].is_floating_point() else max(s[k] for s in states))
            for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Test accuracy of a node mid-run with its own BatchNorm statistics against "
                    "the nodes' mean statistics (the best gossiping them could give).")
    ap.add_argument("--nodes", type=int, default=4, help="nodes, one rank each (default 4).")
    ap.add_argument("--steps", type=int, default=600, help="steps per run (default 600).")
    ap.add_argument("--every", type=int, default=100,
                    help="steps between snapshots (default 100).")
    ap.add_argument("--seeds", type=int, default=3, help="runs, seeds 0..N-1 (default 3).")
    ap.add_argument("--gossip", default="slow-link", choices=("slow-link", "every-step"),
                    help="slow-link: 2-bit, every 16 steps in 4 fragments, outer momentum "
                         "(the README's setting); every-step: ASSGD's default, 4-bit each step.")
    ap.add_argument("--wait-free", action="store_true", help="wait-free gossip.")
    args = ap.parse_args(argv)
    if args.nodes < 2 or args.steps < args.every or args.every < 1 or args.seeds < 1:
        ap.error("need --nodes >= 2, --every >= 1, --steps >= --every and --seeds >= 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.cluster import workloads as W
    from bench.common import cpu_model, load_average
    from qcomm.testing.multiprocess import run_world

    comm = ({"bits": 2, "sync_every": 16, "fragments": 4, "gamma": 0.8, "rounding": "nearest",
             "outer_momentum": 0.9, "outer_lr": 0.5} if args.gossip == "slow-link" else {})
    if args.wait_free:
        comm["wait_free"] = True
    print(f"# cpu {cpu_model()}; load {load_average()}; {args.nodes}x1, {comm}")
    info = W.WORKLOADS["mnist1d-bn"]
    ways = ("own", "mean buffers", "mean all")
    table: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "mnist1d.npz"
        W.make_data("mnist1d-bn", data, seed=0)
        for seed in range(args.seeds):
            runs = run_world(_train, args.nodes, args=(str(data), seed, args.steps, args.every,
                                                       comm), timeout_s=3600)
            work = W.load("mnist1d-bn", data, rank=0, seed=seed, batch=info.batch,
                          total_steps=1, args=SimpleNamespace(width=info.width,
                                                              depth=info.depth))
            model = work.make_model()
            for mark in range(len(runs[0])):
                states = [r[mark] for r in runs]
                buffers = [k for k, _ in model.named_buffers()]
                mean_buf = _mean(states, buffers)
                mean_all = _mean(states, list(states[0]))
                acc: dict[str, list[float]] = {w: [] for w in ways}
                for st in states:
                    for way, state in (("own", st), ("mean buffers", {**st, **mean_buf}),
                                       ("mean all", mean_all)):
                        model.load_state_dict(state)
                        acc[way].append(work.evaluate(model))
                row = table.setdefault((mark + 1) * args.every, {w: [] for w in ways})
                for way in ways:
                    row[way].append(statistics.fmean(acc[way]))
    print(f"\n| step | {' | '.join(ways)} | own - mean buffers (points) |")
    print("|---|" + "---|" * (len(ways) + 1))
    gaps = []
    for step, row in sorted(table.items()):
        med = {w: statistics.median(row[w]) for w in ways}
        gap = 100 * (med["own"] - med["mean buffers"])
        gaps.append(gap)
        print(f"| {step} | " + " | ".join(f"{100 * med[w]:.1f}%" for w in ways)
              + f" | {gap:+.2f} |")
    print(f"\nlargest |own - mean buffers|: {max(abs(g) for g in gaps):.2f} points "
          f"(medians of {args.seeds} seeds, each the mean over {args.nodes} nodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
