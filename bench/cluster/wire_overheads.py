"""Bytes on an emulated link that no byte formula counts: Gloo's cost per collective, and
torchft's control traffic while no data moves. Explains the gap between the interface
counters and the formula of torchft's DiLoCo (bench/cluster/README.md).

Run as root, on 2 nodes x 1 process:

    sudo bench/cluster/netns.sh run --nodes 2 --procs 1 --rate 1gbit --timeout 300 -- \\
        bench/cluster/wire_overheads.py

Every figure is what node 0 sent on its link (qceth0 tx_bytes and packets), between two
barriers:

1. the charlm model's parameters (1,230,976 fp32) allreduced ``--repeats`` times as one flat
   buffer, and as one allreduce per tensor (78 tensors, what torchft's DiLoCo does without
   bucketization); the difference per collective is Gloo's cost of a collective;
2. 78 allreduces of 128 floats each (tiny: almost all of it is that cost);
3. ``--idle`` seconds with torchft's lighthouse, Managers and a DiLoCo set up but no training
   step: heartbeats (every 100 ms) and their answers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    # Run by path (netns.sh run): the repository root first on sys.path, so that
    # `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import charlm
from bench.cluster import methods as M
from bench.cluster import training as T
from bench.cluster.link_counters import read_iface_bytes

IFACE = os.environ.get("QCB_IFACE", "qceth0")


def measure(name: str, fn: Callable[[], None], ops: int, payload: int) -> None:
    """Run ``fn`` between barriers; rank 0 prints what its node sent, and per operation."""
    dist.barrier()
    a = read_iface_bytes(IFACE)
    fn()
    dist.barrier()
    b = read_iface_bytes(IFACE)
    if dist.get_rank() == 0:
        tx, pk = b[0] - a[0], b[2] - a[2]
        tcp = M.tcp_payload(tx, pk)
        extra = (tcp - payload) / ops if ops else 0.0
        print(f"{name:<34} tx {tx:>10} B  packets {pk:>6}  TCP payload {tcp:>10.0f} B  "
              f"formula {payload:>10} B  beyond it per op {extra:7.0f} B", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--repeats", type=int, default=3, help="Rounds of each allreduce pattern.")
    p.add_argument("--idle", type=float, default=5.0,
                   help="Seconds of torchft control traffic to count (0: skip).")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    if world != 2 or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise SystemExit("wire_overheads.py: run it on 2 nodes x 1 proc (a ring of 2: each rank "
                         "sends exactly its buffer once per allreduce)")
    torch.manual_seed(0)
    model = charlm.CharTransformer()
    tensors = [q.detach().clone() for q in model.parameters()]
    flat = torch.cat([t.flatten() for t in tensors])
    for t in tensors:  # connections and buffers set up outside the measurement
        dist.all_reduce(t)
    r, n = args.repeats, len(tensors)
    nbytes = flat.numel() * 4  # a ring of 2 ranks: 2 (W-1)/W = 1 buffer per rank
    if dist.get_rank() == 0:
        print(f"{n} tensors, {flat.numel()} parameters, {r} rounds; node 0's link ({IFACE})")
    measure("flat buffer", lambda: [dist.all_reduce(flat) for _ in range(r)], r, r * nbytes)
    measure("one allreduce per tensor", lambda: [[dist.all_reduce(t) for t in tensors]
                                                 for _ in range(r)], r * n, r * nbytes)
    small = [torch.zeros(128) for _ in range(n)]
    measure("78 x 128 floats", lambda: [[dist.all_reduce(t) for t in small] for _ in range(r)],
            r * n, r * n * 128 * 4)
    if args.idle > 0:
        from bench.cluster import torchft_methods

        cfg = T.Config(lr=1e-3, momentum=0.0, layout=T.Layout(2, 1), optimizer="adamw")
        built = torchft_methods.build("torchft-diloco", charlm.CharTransformer(width=32,
                                                                               layers=1), cfg)
        time.sleep(1.0)
        measure(f"torchft idle, {args.idle:g} s", lambda: time.sleep(args.idle), 1, 0)
        built.close()
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
