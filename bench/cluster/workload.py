"""One rank of the cluster benchmark: MNIST-1D, an MLP, one method, a timed window of steps.

Run under torchrun (one torchrun per emulated node, see netns.sh); compare.py builds the command.
Every method gets the same model, initial weights, per-rank batches, batch size, lr schedule and
step budget. What happens on each rank:

1. a compute-only baseline: ``--baseline-steps`` forward/backward/SGD steps on a throw-away copy
   of the model, no communication, all ranks at once (so the CPU is as contended as in training);
   ``1 - baseline / step time`` is the share of a step that is communication (or waiting for it);
2. ``--warmup`` training steps, untimed (connection set-up, first-bucket rebuilds, allocator);
3. barrier, then local rank 0 reads its node's interface counters (/proc/net/dev of the node's
   namespace) and every rank reads qcomm's byte counters;
4. ``--steps`` timed training steps; rank 0 keeps a copy of its parameters every
   ``--snapshot-every`` steps with the wall-clock time since the window opened;
5. traffic in flight is completed, barrier, counters read again;
6. the final model is made (e.g. parameters averaged), rank 0 evaluates it and every snapshot on
   the test set, and writes one JSON with every rank's numbers to ``--out``.

Progress goes to stdout as ``QCB_PROGRESS <done> <total>`` lines (rank 0), for compare.py's bar.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import methods as M  # this directory is not a package; torchrun runs the file


def _method_name(name: str) -> str:
    if name not in M.METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}")
    return name


def make_model(width: int, depth: int) -> nn.Module:
    """MLP 40 -> width (x depth hidden layers, ReLU) -> 10."""
    layers: list[nn.Module] = []
    d = 40
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, 10))
    return nn.Sequential(*layers)


def read_iface_bytes(iface: str) -> tuple[int, int, int]:
    """(tx_bytes, rx_bytes, tx_packets) of ``iface`` in this process's network namespace
    (/proc/net/dev is per namespace, unlike a /sys that may be mounted from another one)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[8]), int(fields[0]), int(fields[9])
    raise RuntimeError(f"interface {iface!r} not found in /proc/net/dev (set QCB_IFACE)")


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def _write_profile(profiler, path: Path) -> None:
    """Top functions of the timed steps by cumulative and by own time (main thread only: Gloo's
    and gossip's background work shows as time spent waiting for it)."""
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("cumulative").print_stats(35)
    stats.sort_stats("tottime").print_stats(25)
    path.write_text(buf.getvalue())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, type=_method_name,
                   help=f"one of {list(M.METHODS)} or a qcomm variant such as assgd-4-h8f4")
    p.add_argument("--data", required=True, help="npz with x, y, x_test, y_test (compare.py)")
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=600, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (they train too)")
    p.add_argument("--baseline-steps", type=int, default=20)
    p.add_argument("--snapshot-every", type=int, default=0, help="0: about 60 snapshots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--localsgd-period", type=int, default=8)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--profile", action="store_true",
                   help="cProfile the timed steps; top functions to OUT.prof<rank>.txt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks per 2-core machine: oversubscription distorts times
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("GROUP_RANK", str(rank // procs)))
    layout = M.Layout(world // procs, procs)
    iface = os.environ.get("QCB_IFACE", "qceth0")

    data = np.load(args.data)
    x = torch.from_numpy(data["x"]).float()
    y = torch.from_numpy(data["y"]).long()
    x_test = torch.from_numpy(data["x_test"]).float()
    y_test = torch.from_numpy(data["y_test"]).long()

    torch.manual_seed(args.seed)  # same initial weights on every rank and for every method
    module = make_model(args.width, args.depth)
    shapes = [list(p.shape) for p in module.parameters()]
    numel = sum(p.numel() for p in module.parameters())
    total = args.warmup + args.steps
    # Every rank draws its own batches; the stream depends on (seed, rank) only, so every
    # method sees the same batches in the same order.
    gen = torch.Generator().manual_seed(args.seed * 1009 + rank)
    batches = torch.randint(0, x.shape[0], (total, args.batch), generator=gen)

    # 1. compute-only baseline on a copy (never touches the trained model's state)
    shadow = make_model(args.width, args.depth)
    shadow.load_state_dict(module.state_dict())
    sgd = torch.optim.SGD(shadow.parameters(), lr=args.lr, momentum=args.momentum)
    dist.barrier()
    base_times = []
    for i in range(args.baseline_steps):
        idx = batches[i % total]
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(shadow(x[idx]), y[idx])
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        sgd.step()
        base_times.append(time.perf_counter() - t)
    del shadow, sgd
    dist.barrier()

    cfg = M.Config(lr=args.lr, momentum=args.momentum, layout=layout, seed=args.seed,
                   powersgd_rank=args.powersgd_rank, localsgd_period=args.localsgd_period,
                   localsgd_warmup=args.warmup)
    built = M.build(args.method, module, cfg)
    model, opt = built.model, built.optimizer

    def train_step(i: int) -> tuple[float, float]:
        idx = batches[i]
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP methods communicate here (overlapped with backward)
        t1 = time.perf_counter()
        opt.step()  # ASSGD / post-local SGD communicate here
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    # 2. warm-up
    for i in range(args.warmup):
        train_step(i)
    built.flush()
    dist.barrier()

    # 3. open the window
    counters0 = read_iface_bytes(iface) if local_rank == 0 and layout.nodes > 1 else None
    stats0 = built.comm_stats()
    snap_every = args.snapshot_every or max(1, args.steps // 60)
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = []
    step_times: list[float] = []
    fwd_bwd: list[float] = []
    opt_times: list[float] = []
    report_every = max(1, args.steps // 50)
    t_open = time.perf_counter()
    if rank == 0:
        snapshots.append((0, 0.0, {k: v.clone() for k, v in built.module.state_dict().items()}))

    # 4. the timed steps
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for s in range(1, args.steps + 1):
        t = time.perf_counter()
        a, b = train_step(args.warmup + s - 1)
        step_times.append(time.perf_counter() - t)
        fwd_bwd.append(a)
        opt_times.append(b)
        if rank == 0:
            if s % snap_every == 0 or s == args.steps:
                elapsed = time.perf_counter() - t_open
                # Parameters only: a copy of 2 MB costs ~1 ms, evaluation happens after the run.
                snapshots.append((s, elapsed, {k: v.clone() for k, v in
                                               built.module.state_dict().items()}))
            if s % report_every == 0 or s == args.steps:
                print(f"QCB_PROGRESS {s} {args.steps}", flush=True)
    t_loop = time.perf_counter() - t_open
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, Path(f"{args.out}.prof{rank}.txt"))

    # 5. close the window
    built.flush()
    dist.barrier()
    counters1 = read_iface_bytes(iface) if counters0 is not None else None
    stats1 = built.comm_stats()
    t_window = time.perf_counter() - t_open

    # 6. final model, evaluation, results
    built.finalize()
    mine = {
        "rank": rank, "node": node, "local_rank": local_rank,
        "step_median_s": statistics.median(step_times),
        "step_mean_s": statistics.fmean(step_times),
        "fwd_bwd_median_s": statistics.median(fwd_bwd),
        "opt_step_median_s": statistics.median(opt_times),
        "baseline_median_s": statistics.median(base_times),
        "loop_s": t_loop, "window_s": t_window,
        "iface_tx_bytes": None if counters0 is None else counters1[0] - counters0[0],
        "iface_rx_bytes": None if counters0 is None else counters1[1] - counters0[1],
        "iface_tx_packets": None if counters0 is None else counters1[2] - counters0[2],
        "qcomm_bytes": None if stats0 is None else
        {k: stats1[k] - stats0[k] for k in stats1},
    }
    gathered: list[dict] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        evaluator = make_model(args.width, args.depth)
        curve = []
        for s, elapsed, state in snapshots:
            evaluator.load_state_dict(state)
            curve.append({"step": s, "time_s": elapsed,
                          "test_acc": accuracy(evaluator, x_test, y_test)})
        final_acc = accuracy(built.module, x_test, y_test)
        result = {
            "method": args.method,
            "layout": {"nodes": layout.nodes, "procs": layout.procs, "world": world},
            "model": {"width": args.width, "depth": args.depth, "params": numel,
                      "shapes": shapes},
            "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
            "final_test_acc": final_acc,
            "curve": curve,
            "ranks": gathered,
            "notes": built.notes,
        }
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)
        print(f"QCB_DONE {args.method} final_acc={final_acc:.4f}", flush=True)
    built.close()
    dist.barrier()
    # Leave without tearing down the process group: with PowerSGD's hook a rank sometimes
    # aborts in Gloo's teardown ("terminate called without an active exception", SIGABRT) after
    # everything finished, which would turn a complete run into a failed one. The results are
    # written and every rank passed the barrier above; the OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
