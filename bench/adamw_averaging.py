"""Can parameter averaging between nodes reach DDP's final loss with AdamW, and does averaging
AdamW's moments too close the gap? N nodes emulated in one process on the charlm workload.

    python bench/adamw_averaging.py [--nodes 4] [--steps 400] [--variants ddp,params-every-1,...]
        [--json OUT.json]

Variants, each from the same weights on the same batches (how the nodes are emulated, and what
each variant tests: bench/README.md, "adamw_averaging.py"):

- ``ddp``: ONE model, AdamW on the mean of the N nodes' gradients (what DDP computes);
- ``params-every-H``: each node steps its own AdamW on its own gradient; every H steps every
  node's parameters are replaced by their exact mean;
- ``params+moments-every-H``: the same, and AdamW's ``exp_avg`` and ``exp_avg_sq`` too;
- ``params+exp_avg-every-H``: the same with ``exp_avg`` only;
- ``params+m+vddp-every-1``: parameters and ``exp_avg`` averaged after every step, and the
  shared ``exp_avg_sq`` rebuilt from the mean gradient, as DDP's is;
- a ``-vscaled`` suffix on any of those: each node's AdamW acts as if its ``exp_avg_sq`` were
  divided by N (lr x sqrt(N), eps x sqrt(N), weight decay / sqrt(N)); it costs no traffic.

Reported per variant: the final validation loss (of the nodes' mean parameters), its ratio to
``ddp``'s, and the first evaluated step at which the loss is at most ``--target`` (steps of the
timed window, as the cluster's curves count them: the ``--warmup`` steps come before step 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import workloads as W
from bench.cluster.training import LR_SCHEDULES, scheduled

BETAS = (0.9, 0.95)  # the cluster's AdamW (bench/cluster/training.py, inner_optimizer)
EPS = 1e-8  # torch's default, which the cluster uses
# Most telling first: a run cut short still answers the question.
DEFAULT_VARIANTS = ("ddp,params-every-1,params+moments-every-1,params+m+vddp-every-1,"
                    "params-every-2,params+moments-every-2")

_VARIANT = re.compile(r"(?P<what>params|params\+moments|params\+exp_avg|params\+m\+vddp)"
                      r"-every-(?P<h>\d+)(?P<vscaled>-vscaled)?")


@dataclass(frozen=True)
class Variant:
    """One way to train: ``what`` is averaged every ``every`` steps (``ddp``: gradients every
    step, one model); ``vscaled``: the nodes' AdamW as if exp_avg_sq were divided by N."""

    name: str
    what: str
    every: int
    vscaled: bool = False


def parse_variant(name: str) -> Variant:
    """A variant's name -> :class:`Variant`.

    Raises:
        ValueError: an unknown name, H < 1, or vddp with H != 1.
    """
    if name == "ddp":
        return Variant(name, "ddp", 1)
    m = _VARIANT.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown variant {name!r}: ddp, params-every-H, "
                         "params+moments-every-H, params+exp_avg-every-H or "
                         "params+m+vddp-every-1, optionally with -vscaled")
    every = int(m["h"])
    if every < 1:
        raise ValueError(f"{name}: H must be 1 or more")
    if m["what"] == "params+m+vddp" and every != 1:
        raise ValueError(f"{name}: vddp needs the mean gradient of every step, so H must be 1")
    return Variant(name, m["what"], every, bool(m["vscaled"]))


# ---------------------------------------------------------------------------------------------
# the workload: the cluster's charlm, one Workload per node


def load_nodes(args: argparse.Namespace, data: Path) -> list[Any]:
    """Node k's workload exactly as rank k of the cluster builds it (workloads.load)."""
    wargs = SimpleNamespace(width=args.width, depth=args.layers, heads=args.heads,
                            context=args.context, eval_windows=args.eval_windows)
    total = args.warmup + args.steps
    if args.identical_batches:
        node0 = W.load("charlm", data, rank=0, seed=args.seed, batch=args.batch,
                       total_steps=total, args=wargs)
        return [node0] * args.nodes
    return [W.load("charlm", data, rank=k, seed=args.seed, batch=args.batch, total_steps=total,
                   args=wargs) for k in range(args.nodes)]


def adamw(params, args: argparse.Namespace, scale: float = 1.0) -> torch.optim.AdamW:
    """The cluster's AdamW; ``scale``: as if exp_avg_sq were divided by ``scale**2``."""
    return torch.optim.AdamW(params, lr=args.lr * scale, betas=BETAS, eps=EPS * scale,
                             weight_decay=args.weight_decay / scale)


@torch.no_grad()
def mean_into(tensors: list[torch.Tensor]) -> None:
    """Every tensor <- the exact (float32) mean of all, summed in node order."""
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc.add_(t)
    acc.div_(len(tensors))
    for t in tensors:
        t.copy_(acc)


def mean_state(models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The nodes' parameters averaged (the model a user would keep), as a state dict."""
    states = [m.state_dict() for m in models]
    out = {}
    for key, first in states[0].items():
        acc = first.clone()
        for st in states[1:]:
            acc.add_(st[key])
        out[key] = acc.div_(len(states))
    return out


class Trainer:
    """One variant's nodes: the model replicas (one for ``ddp``) and their AdamW states."""

    def __init__(self, variant: Variant, nodes: list[Any], args: argparse.Namespace,
                 init: dict[str, torch.Tensor]):
        self.v, self.nodes, self.n = variant, nodes, len(nodes)
        replicas = 1 if variant.what == "ddp" else self.n
        self.models = []
        for _ in range(replicas):
            m = nodes[0].make_model()
            m.load_state_dict(init)
            self.models.append(m)
        scale = math.sqrt(self.n) if variant.vscaled else 1.0
        self.opts = [adamw(m.parameters(), args, scale) for m in self.models]
        # The cluster's schedule, by the step's index (warm-up steps included), every node alike.
        self.lr_at = [scheduled(opt, args.lr_schedule, args.warmup + args.steps, args.lr * scale)
                      for opt in self.opts]
        self.params = [list(m.parameters()) for m in self.models]
        self.evaluator = nodes[0].make_model()
        self.step = 0

    def train_step(self, i: int) -> None:
        """Training step on batch ``i`` (every node's ``i``-th batch)."""
        self.step += 1
        for at in self.lr_at:
            at(i)
        if self.v.what == "ddp":
            model, opt = self.models[0], self.opts[0]
            opt.zero_grad(set_to_none=True)
            for node in self.nodes:  # p.grad accumulates the sum over nodes
                node.loss(model, i).backward()
            with torch.no_grad():
                for p in self.params[0]:
                    p.grad.div_(self.n)
            opt.step()
            return
        for node, model, opt in zip(self.nodes, self.models, self.opts, strict=True):
            opt.zero_grad(set_to_none=True)
            node.loss(model, i).backward()
        vddp = self.v.what == "params+m+vddp"
        if vddp:  # the shared second moment before the step, and the nodes' mean gradient
            with torch.no_grad():
                v_old = [self.opts[0].state[p]["exp_avg_sq"].clone()
                         if p in self.opts[0].state else torch.zeros_like(p)
                         for p in self.params[0]]
                g_mean = [g.clone() for g in (p.grad for p in self.params[0])]
                for ps in self.params[1:]:
                    for acc, p in zip(g_mean, ps, strict=True):
                        acc.add_(p.grad)
                for acc in g_mean:
                    acc.div_(self.n)
        for opt in self.opts:
            opt.step()
        if self.step % self.v.every:
            return
        with torch.no_grad():
            for j, group in enumerate(zip(*self.params, strict=True)):
                mean_into(list(group))
                if self.v.what == "params":
                    continue
                states = [opt.state[p] for opt, p in zip(self.opts, group, strict=True)]
                mean_into([st["exp_avg"] for st in states])
                if self.v.what == "params+moments":
                    mean_into([st["exp_avg_sq"] for st in states])
                elif vddp:
                    beta2 = self.opts[0].param_groups[0]["betas"][1]
                    shared = v_old[j].mul_(beta2).addcmul_(g_mean[j], g_mean[j],
                                                           value=1 - beta2)
                    for st in states:
                        st["exp_avg_sq"].copy_(shared)

    def evaluate(self) -> float:
        """Validation loss of the nodes' mean parameters (``ddp``: of its one model)."""
        if len(self.models) == 1:
            return self.nodes[0].evaluate(self.models[0])
        self.evaluator.load_state_dict(mean_state(self.models))
        return self.nodes[0].evaluate(self.evaluator)


def run_variant(variant: Variant, nodes: list[Any], args: argparse.Namespace,
                init: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train one variant for ``warmup + steps`` steps; its curve, final loss and timing."""
    t0 = time.perf_counter()
    tr = Trainer(variant, nodes, args, init)
    for i in range(args.warmup):
        tr.train_step(i)
    curve = [{"step": 0, "val_loss": tr.evaluate()}]
    for s in range(1, args.steps + 1):
        tr.train_step(args.warmup + s - 1)
        if s % args.eval_every == 0 or s == args.steps:
            curve.append({"step": s, "val_loss": tr.evaluate()})
        if args.progress and s % max(1, args.steps // 8) == 0:
            print(f"  {variant.name}: step {s}/{args.steps}, "
                  f"{time.perf_counter() - t0:.0f} s, val loss {curve[-1]['val_loss']:.4f} "
                  f"at step {curve[-1]['step']}",
                  file=sys.stderr, flush=True)
    reached = next((p["step"] for p in curve if p["val_loss"] <= args.target), None)
    return {"variant": variant.name, "final_val_loss": curve[-1]["val_loss"],
            "steps_to_target": reached, "wall_s": time.perf_counter() - t0,
            "final_params_sha256": params_digest(tr), "curve": curve}


def params_digest(tr: Trainer) -> str:
    """sha256 of the final model's parameters (the nodes' mean): equal digests, equal bits."""
    h = hashlib.sha256()
    state = tr.models[0].state_dict() if len(tr.models) == 1 else mean_state(tr.models)
    for key, value in state.items():
        h.update(key.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    first, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(description=" ".join(first.split()), epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    info = W.WORKLOADS["charlm"]
    p.add_argument("--nodes", type=int, default=4,
                   help="Nodes emulated (node k sees the cluster's rank k batches).")
    p.add_argument("--steps", type=int, default=info.steps,
                   help="Steps of the window after the warm-up (the cluster's: 400).")
    p.add_argument("--warmup", type=int, default=5,
                   help="Steps before the window that train too (the cluster's untimed "
                        "warm-up: 5).")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="Comma list of variants, run one after another (the module docstring "
                        "explains the names).")
    p.add_argument("--lr", type=float, default=info.lr, help="AdamW's learning rate.")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="The learning rate over --warmup + --steps, the cluster bench's: "
                        "constant, or cosine (a linear warm-up over the first 5%%, then a "
                        "cosine to 0 at the end).")
    p.add_argument("--weight-decay", type=float, default=info.weight_decay,
                   help="AdamW's decoupled weight decay.")
    p.add_argument("--batch", type=int, default=info.batch,
                   help="Windows per node and step.")
    p.add_argument("--width", type=int, default=info.width, help="The transformer's width.")
    p.add_argument("--layers", type=int, default=info.depth,
                   help="The transformer's blocks.")
    p.add_argument("--heads", type=int, default=4, help="Attention heads.")
    p.add_argument("--context", type=int, default=64, help="Characters per window.")
    p.add_argument("--eval-windows", type=int, default=256,
                   help="Fixed validation windows the loss is measured on.")
    p.add_argument("--eval-every", type=int, default=20,
                   help="Window steps between validation losses (the curve and the steps to "
                        "target).")
    p.add_argument("--target", type=float, default=info.target,
                   help="The validation loss whose first reaching is reported.")
    p.add_argument("--seed", type=int, default=0, help="The seed of weights and batches.")
    p.add_argument("--identical-batches", action="store_true",
                   help="Every node sees node 0's batches (a check: averaging then changes "
                        "nothing).")
    p.add_argument("--data", default=None,
                   help="The corpus npz (bench/cluster/compare.py's); built from this "
                        "interpreter's stdlib when left out.")
    p.add_argument("--json", default=None,
                   help="Write the results (and the curves) to this JSON file, rewritten "
                        "after every variant.")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="No progress lines on stderr.")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.steps < 1 or args.warmup < 0 or args.eval_every < 1:
        p.error("--nodes, --steps and --eval-every must be 1 or more, --warmup 0 or more")
    try:
        args.variant_list = [parse_variant(v.strip()) for v in args.variants.split(",")
                             if v.strip()]
    except ValueError as e:
        p.error(str(e))
    return args


def environment() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu,
            "cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "charlm.npz"
        data_info = {} if args.data else W.make_data("charlm", data, seed=args.seed)
        nodes = load_nodes(args, data)
    torch.manual_seed(args.seed)  # the cluster's initial weights (workload.py's main)
    init = {k: v.clone() for k, v in nodes[0].make_model().state_dict().items()}
    config = {k: v for k, v in vars(args).items() if k not in ("variant_list", "json")}
    out: dict[str, Any] = {"environment": env, "config": config,
                           "data": {**data_info, **nodes[0].data_config},
                           "model": nodes[0].model_config, "results": []}
    ref = None
    for v in args.variant_list:
        r = run_variant(v, nodes, args, init)
        if v.what == "ddp" and ref is None:
            ref = r["final_val_loss"]
        out["results"].append(r)
        for row in out["results"]:
            row["ratio_to_ddp"] = None if ref is None else row["final_val_loss"] / ref
        ratio = "-" if ref is None else f"{r['final_val_loss'] / ref:.4f}"
        print(f"{v.name:32s} final {r['final_val_loss']:.4f}  ratio {ratio}  "
              f"to {args.target}: {r['steps_to_target']}  ({r['wall_s']:.0f} s)", flush=True)
        if args.json:
            tmp_path = Path(f"{args.json}.tmp")
            tmp_path.write_text(json.dumps(out, indent=1))
            tmp_path.replace(args.json)
    print_table(out, args.target)
    return out


def print_table(out: dict[str, Any], target: float) -> None:
    print(f"\n| variant | final val loss | ratio to ddp | steps to {target} | wall s |")
    print("|---|---|---|---|---|")
    for r in out["results"]:
        ratio = "-" if r.get("ratio_to_ddp") is None else f"{r['ratio_to_ddp']:.4f}"
        reached = "never" if r["steps_to_target"] is None else str(r["steps_to_target"])
        print(f"| {r['variant']} | {r['final_val_loss']:.4f} | {ratio} | {reached} | "
              f"{r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
