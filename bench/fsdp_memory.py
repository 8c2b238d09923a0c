"""Memory per rank: FSDP2 inside the node with qcomm between nodes, against FSDP2 alone (HSDP)
and against qcomm's full-replica mode.

    python bench/fsdp_memory.py                               # 2 nodes, 2 and 4 ranks each
    python bench/fsdp_memory.py --params 8M,32M --ppn 2,4 --steps 3

``--nodes`` x ``procs_per_node`` processes (Gloo on this machine, CPU) each build the same model,
a stack of square ``Linear`` layers holding about ``--params`` parameters, and take ``--steps``
AdamW steps three ways:

- ``fsdp2``: FSDP2 alone, ``fully_shard`` per layer and at the root over the whole 2-D mesh
  ``(nodes, procs_per_node)`` (HSDP: sharded inside the node, all-reduced between nodes);
- ``qcomm-sharded``: ``fully_shard`` over the mesh's ``"shard"`` dimension (the node's ranks),
  ``HierarchicalOptimizer(AdamW)`` gossiping each rank's shards between nodes;
- ``qcomm-replica``: the whole model on every rank, DDP inside the node
  (``opt.data_parallel``), each local rank gossiping its slice between nodes.

The sharded models are built on the meta device and materialized sharded (as torchtitan does),
so no rank ever holds the whole model. qcomm runs the README's AdamW slow-link setting.

Reported per rank: the peak resident memory above what the process held just before the model
was built (``ru_maxrss`` less the RSS then: everything the model, its training and the
communication allocated, allocator slack included), and, counted exactly, the bytes of qcomm's
own tensors (its gossip state: public copies, neighbours' copies, residuals, scratch; storages
shared with the parameters, gradients or optimizer state are not counted). Medians over the
ranks; each configuration runs in fresh processes.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Any

MODES = ("fsdp2", "qcomm-sharded", "qcomm-replica")
LAYERS = 8


def _rss_bytes() -> int:
    """This process's resident memory now."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensors_in(obj: Any, depth: int = 0, seen: set[int] | None = None) -> list[Any]:
    """Every tensor reachable from ``obj`` through attributes, dicts, lists, tuples and deques
    (depth at most 8), each object visited once."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple | deque | set):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("qcomm"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors_in(item, depth + 1, seen)]


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_key(t: Any) -> int:
    return _local(t).untyped_storage().data_ptr()


def _model(width: int, device: Any) -> Any:
    import torch

    with torch.device(device):
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])


def _build(mode: str, ppn: int, width: int, mesh: Any, rank: int) -> tuple[Any, Any]:
    """The model and its optimizer, as ``mode`` builds them (module docstring)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from qcomm.sgd import ADAMW_SLOW_LINK, HierarchicalOptimizer

    if mode == "qcomm-replica":
        torch.manual_seed(0)
        model = _model(width, "cpu")
        opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    procs_per_node=ppn, **ADAMW_SLOW_LINK)
        return opt.data_parallel(model), opt
    model = _model(width, "meta")
    shard_over = mesh if mode == "fsdp2" else mesh["shard"]
    for layer in model:
        fully_shard(layer, mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rank % ppn)   # one shard per local rank, alike
    with torch.no_grad():
        for p in model.parameters():
            _local(p).normal_(0.0, width ** -0.5, generator=gen)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, (inner if mode == "fsdp2" else
                   HierarchicalOptimizer(inner, procs_per_node=ppn, **ADAMW_SLOW_LINK))


def _train(model: Any, opt: Any, width: int, steps: int, rank: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()


def _qcomm_bytes(model: Any, opt: Any) -> int:
    """The bytes of the tensors qcomm's optimizer holds beyond the parameters, their gradients
    and the inner optimizer's state."""
    import torch

    params = list(model.parameters())
    owned = {_storage_key(p) for p in params}
    owned |= {_storage_key(p.grad) for p in params if p.grad is not None}
    owned |= {_storage_key(t) for st in opt.optimizer.state.values() for t in st.values()
              if isinstance(t, torch.Tensor) and t.numel() > 1}
    seen: dict[int, int] = {}
    for t in _tensors_in(opt):
        key = _storage_key(t)
        if key and key not in owned:
            seen[key] = max(seen.get(key, 0), _local(t).untyped_storage().nbytes())
    return sum(seen.values())


def _body(rank: int, world: int, mode: str, ppn: int, width: int, steps: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // ppn, ppn), mesh_dim_names=("replicate", "shard"))
    # A small model the same way first: what the first use of FSDP2, DTensor, DDP and qcomm
    # loads and allocates once (lazy imports, communicators) is then in the baseline.
    model, opt = _build(mode, ppn, 64, mesh, rank)
    _train(model, opt, 64, 1, rank)
    if mode != "fsdp2":
        opt.close()
    del model, opt
    gc.collect()
    before = _rss_bytes()
    model, opt = _build(mode, ppn, width, mesh, rank)
    _train(model, opt, width, steps, rank)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    qcomm_bytes = 0 if mode == "fsdp2" else _qcomm_bytes(model, opt)
    if mode != "fsdp2":
        opt.close()
    params = list(model.parameters())
    return {"peak": peak, "local_numel": sum(_local(p).numel() for p in params),
            "qcomm_bytes": qcomm_bytes, "numel": sum(p.numel() for p in params)}


def _width_for(params: int) -> int:
    """The width whose ``LAYERS`` square layers hold about ``params`` parameters, rounded to 64."""
    return max(64, round((params / LAYERS) ** 0.5 / 64) * 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Peak memory per rank: FSDP2 inside the node with qcomm between nodes, "
                    "FSDP2 alone (HSDP), and qcomm's full-replica mode.")
    ap.add_argument("--params", default="8M,32M",
                    help="model sizes, comma list with K/M suffixes (default 8M,32M).")
    ap.add_argument("--ppn", default="2,4", help="ranks per node, comma list (default 2,4).")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (default 2).")
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps per run (default 3).")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma list of {', '.join(MODES)} (default all).")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.common import cpu_model, load_average, parse_list, parse_size
    from qcomm.testing.multiprocess import run_world
    from qcomm.validation import did_you_mean

    sizes = parse_list(args.params, parse_size, "--params")
    ppns = parse_list(args.ppn, int, "--ppn")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r}{did_you_mean(m, MODES)}; allowed: {MODES}")
    if args.nodes < 2 or args.steps < 1 or min(ppns) < 1:
        ap.error("need --nodes >= 2, --steps >= 1 and every --ppn >= 1")
    from qcomm.sgd import ADAMW_SLOW_LINK

    print(f"# cpu {cpu_model()}; load {load_average()}; {args.nodes} nodes; {LAYERS} layers; "
          f"AdamW, {args.steps} steps; qcomm {dict(ADAMW_SLOW_LINK)}")
    print("| params | ranks per node | mode | peak MB per rank | qcomm's tensors MB | "
          "local params MB |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        width = _width_for(size)
        for ppn in ppns:
            for mode in modes:
                res = run_world(_body, args.nodes * ppn,
                                args=(mode, ppn, width, args.steps), timeout_s=1800)
                med = {key: statistics.median(r[key] for r in res)
                       for key in ("peak", "qcomm_bytes", "local_numel")}
                print(f"| {res[0]['numel'] / 1e6:.1f}M | {ppn} | {mode} | "
                      f"{med['peak'] / 2**20:.0f} | {med['qcomm_bytes'] / 2**20:.0f} | "
                      f"{4 * med['local_numel'] / 2**20:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
