"""Why a run ends where it ends: MNIST-1D trained to the end by several averaging schemes in one
process, the cause of a late decline isolated one knob at a time.

    python bench/finish_line.py --variants slow-link,lockstep,no-outer,local-sgd,diloco,ddp
    python bench/finish_line.py --schedule cosine --num-samples 48000

``--nodes`` members (one rank per node) train the cluster benchmark's ``mnist1d`` workload
(MLP, SGD + momentum, each member its own batches) for ``--steps`` steps each. The gossip
variants run qcomm's own gossip code on an in-memory world (the same code as over Gloo,
deterministic; healthy scenario: every member at full speed, messages visible the next step);
the peers are exact averages computed in the process: DDP (the members' gradient mean every
step), local SGD (the parameter mean every H steps) and DiLoCo (every H steps an outer
Nesterov step on the mean of the members' progress). Reported at every mark: the test accuracy
of the members' average model, and the consensus distance (mean over members of
``|x_i - mean|^2 / |mean|^2``); per variant its final, best and the step of its best.
Variants are listed by ``--help`` and in bench/README.md ("Why a run ends where it ends").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Variant:
    """One averaging scheme: ``kind`` is ``gossip`` (qcomm's gossip, ``comm`` overriding the
    slow-link setting, ``wait_free`` its mode), ``ddp``, ``local-sgd`` or ``diloco`` (exact
    averages every ``period`` steps; DiLoCo's outer Nesterov ``outer_lr``/``outer_momentum``);
    ``knobs`` maps a gossip attribute to a schedule of the run's progress in [0, 1]."""

    kind: str
    comm: dict[str, Any] = field(default_factory=dict)
    wait_free: bool = True
    period: int = 32
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    knobs: tuple[tuple[str, Callable[[float], float]], ...] = ()
    own_progress: bool = False
    lr_by_progress: bool = False
    about: str = ""


def slow_link() -> dict[str, Any]:
    """The library's ``SLOW_LINK``: its gossip settings (the mode is each variant's own)."""
    from qcomm.sgd import SLOW_LINK

    return {k: v for k, v in SLOW_LINK.items() if k not in ("wait_free", "on_peer_loss")}


def _late(start: float, early: float, late: float) -> Callable[[float], float]:
    """``early`` until progress ``start``, then a cosine to ``late`` at the end."""
    def f(p: float) -> float:
        if p <= start:
            return early
        q = (p - start) / (1 - start)
        return late + (early - late) * 0.5 * (1 + math.cos(math.pi * q))
    return f


VARIANTS: dict[str, Variant] = {
    "slow-link": Variant("gossip", about="SLOW_LINK as the README gives it (wait-free)"),
    "lockstep": Variant("gossip", wait_free=False, about="its lockstep form"),
    "no-outer": Variant("gossip", {"outer_momentum": 0.0, "outer_lr": 1.0},
                        about="no outer Nesterov step (plain CHOCO)"),
    "outer-diloco": Variant("gossip", {"outer_momentum": 0.5, "outer_lr": 0.7},
                            about="DiLoCo's outer step (0.7, momentum 0.5) on the gossip"),
    "bits-4": Variant("gossip", {"bits": 4}, about="4-bit codes"),
    "bits-8": Variant("gossip", {"bits": 8}, about="8-bit codes (codec noise ~0)"),
    "gamma-low": Variant("gossip", {"gamma": 0.2}, about="a loose consensus step (0.2)"),
    "h32": Variant("gossip", {"sync_every": 32, "fragments": 4},
                   about="each fragment every 32 steps"),
    "outer-decay": Variant("gossip", knobs=(("outer_lr", _late(0.3, 0.5, 0.1)),),
                           about="outer lr 0.5 -> 0.1 (cosine from 30% of the run)"),
    "gamma-decay": Variant("gossip", knobs=(("gamma", _late(0.3, 0.8, 0.1)),),
                           about="gamma 0.8 -> 0.1 (cosine from 30% of the run)"),
    "slow-link-total": Variant("gossip", {"total_steps": True},
                               about="SLOW_LINK given the run's length (total_steps): its "
                                     "outer step anneals late"),
    "slow-link-total-own": Variant("gossip", {"total_steps": True}, own_progress=True,
                                   about="SLOW_LINK given the run's length, each member's "
                                         "outer step annealed by its own steps rather than "
                                         "the job's progress (what the library did before)"),
    "slow-link-total-job-lr": Variant("gossip", {"total_steps": True}, lr_by_progress=True,
                                      about="SLOW_LINK given the run's length, each member's "
                                            "learning-rate schedule driven by the job's "
                                            "progress (opt.job_progress()) rather than its own "
                                            "steps"),
    "one-peer": Variant("gossip", {"graph": "one-peer-exp"}, wait_free=False,
                        about="the lockstep form on the one-peer exponential graph (one "
                              "partner per round, i XOR 2^(t mod log2 N))"),
    "one-peer-total": Variant("gossip", {"graph": "one-peer-exp", "total_steps": True},
                              wait_free=False, about="the same, given the run's length"),
    "lockstep-total": Variant("gossip", {"total_steps": True}, wait_free=False,
                              about="its lockstep form, given the run's length"),
    "ddp": Variant("ddp", about="the members' gradient mean every step"),
    "local-sgd": Variant("local-sgd", period=32, about="the parameter mean every 32 steps"),
    "diloco": Variant("diloco", period=32, outer_lr=0.7, outer_momentum=0.5,
                      about="DiLoCo H32, outer Nesterov 0.7 / 0.5"),
}


# A peer's tuning grid: DiLoCo every H steps with outer lr o/10 and momentum m/10, local SGD
# every P steps (e.g. diloco-h64-o9-m5, local-sgd-p16).
_DILOCO = re.compile(r"diloco-h(\d+)-o(\d+)-m(\d+)")
_LOCAL_SGD = re.compile(r"local-sgd-p(\d+)")


def variant(name: str) -> Variant | None:
    """The variant called ``name``: one of :data:`VARIANTS`, or a peer of the tuning grid
    (``diloco-hH-oO-mM``, ``local-sgd-pP``); None when there is no such variant."""
    if name in VARIANTS:
        return VARIANTS[name]
    if m := _DILOCO.fullmatch(name):
        h, o, mu = (int(g) for g in m.groups())
        if h >= 1 and 1 <= o <= 20 and mu <= 9:
            return Variant("diloco", period=h, outer_lr=o / 10, outer_momentum=mu / 10,
                           about=f"DiLoCo H{h}, outer Nesterov {o / 10} / {mu / 10}")
    if (m := _LOCAL_SGD.fullmatch(name)) and int(m.group(1)) >= 1:
        return Variant("local-sgd", period=int(m.group(1)),
                       about=f"the parameter mean every {m.group(1)} steps")
    return None


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def run(name: str, seed: int, args: argparse.Namespace, data: Path) -> dict:
    """One run of variant ``name``: the average model's accuracy and the consensus distance at
    every mark."""
    import torch

    from bench.cluster import workloads as W
    from bench.cluster.training import scheduled
    from bench.wait_free_causes import Member
    from qcomm.collectives.gossip.choco import CompressedGossip
    from qcomm.collectives.gossip.one_peer_choco import OnePeerGossip
    from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
    from qcomm.compress import QuantSpec

    torch.set_num_threads(1)
    v = variant(name)
    info = W.WORKLOADS["mnist1d"]
    shape = SimpleNamespace(width=args.width, depth=info.depth)
    comm = {**slow_link(), **v.comm}
    n, total = args.nodes, args.steps
    works = [W.load("mnist1d", data, rank=r, seed=seed, batch=info.batch, total_steps=total,
                    args=shape) for r in range(n)]
    torch.manual_seed(seed)
    numel = _padded(sum(p.numel() for p in works[0].make_model().parameters()),
                    128 * comm["fragments"])
    members = []
    for w in works:
        torch.manual_seed(seed)   # every member starts from the same weights
        members.append(Member(w, numel, args.lr, info.momentum))
    xs = [m.x for m in members]
    # the cluster bench's schedule, set on each member's optimizer by the step's index
    schedules = [scheduled(m.opt, args.schedule, total, args.lr) for m in members]
    gossips: list[Any] = []
    clock = {"t": 0}
    if v.kind == "gossip":
        kw = dict(spec=QuantSpec(comm["bits"], 128, comm["rounding"]), gamma=comm["gamma"],
                  fragments=comm["fragments"],
                  round_period=comm["sync_every"] // comm["fragments"],
                  outer_momentum=comm["outer_momentum"], outer_lr=comm["outer_lr"],
                  staleness=1, total_steps=total if comm.get("total_steps") else None)
        if v.wait_free:
            sim = WaitFreeSimulator(n, numel, periods=[1] * n, delay=1, **kw)
            gossips = sim.members
            if v.own_progress:
                for g in gossips:
                    g.progress = lambda g=g: g.steps
        else:
            world = MemoryWorld(n, clock=lambda: float(clock["t"]))
            graph = comm.get("graph", "ring")
            cls = OnePeerGossip if graph == "one-peer-exp" else CompressedGossip
            gossips = [cls(list(range(n)), world.group(list(range(n)), i), numel, graph=graph,
                           **kw) for i in range(n)]
    anchor = xs[0].clone()
    outer_u = torch.zeros_like(anchor)
    evaluator = works[0].make_model()
    marks = sorted(set(args.marks))
    curve: dict[int, dict[str, float]] = {}
    # member i steps on every periods[i]-th tick (the last one slower with --slow-member);
    # its batches and its learning rate follow its own steps, as on the cluster
    periods = [1] * (n - 1) + [args.slow_member]
    done = [0] * n
    t0 = time.perf_counter()
    for step in range(total):
        for g in gossips:
            for attr, sched in v.knobs:
                setattr(g, attr, sched(step / total))
        if v.kind == "ddp":
            for lr_at in schedules:
                lr_at(step)
            for m in members:
                m.opt.zero_grad()
                m.work.loss(m.model, step).backward()
            for ps in zip(*(list(m.model.parameters()) for m in members), strict=True):
                mean = torch.stack([p.grad for p in ps]).mean(0)
                for p in ps:
                    p.grad.copy_(mean)
            for m in members:
                m.opt.step()
        else:
            for i, m in enumerate(members):
                if step % periods[i]:
                    continue
                # a schedule by the job's progress: a slow member decays with the others
                schedules[i](gossips[i].progress() if v.lr_by_progress else done[i])
                if gossips:
                    gossips[i].prepare()
                m.step(done[i])
                done[i] += 1
                if gossips:
                    gossips[i].end_step(m.x)
            clock["t"] = step + 1
            if gossips and v.wait_free:
                sim.now = float(step + 1)
            if v.kind in ("local-sgd", "diloco") and (step + 1) % v.period == 0:
                mean = torch.stack(xs).mean(0)
                if v.kind == "diloco":   # outer Nesterov on the averaged progress
                    d = mean - anchor
                    outer_u.mul_(v.outer_momentum).add_(d)
                    anchor.add_(d + v.outer_momentum * outer_u, alpha=v.outer_lr)
                    mean = anchor
                for x in xs:
                    x.copy_(mean)
        if step + 1 in marks:
            stacked = torch.stack(xs)
            mean = stacked.mean(0)
            spread = float(((stacked - mean) ** 2).sum(1).mean() / (mean ** 2).sum())
            at = 0
            with torch.no_grad():
                for p in evaluator.parameters():
                    p.copy_(mean[at:at + p.numel()].view_as(p))
                    at += p.numel()
            curve[step + 1] = {"acc": works[0].evaluate(evaluator), "consensus": spread}
    accs = {s: c["acc"] for s, c in curve.items()}
    best = max(accs, key=accs.get)
    # bytes each member sends per step: the gossip's as counted; an exact average as a ring
    # allreduce of float32 parameters sends 2 (n - 1) / n of them, every step (DDP's
    # gradients) or every period
    if gossips:
        sent = statistics.mean(g.stats.bytes_sent["inter"] for g in gossips) / total
    else:
        sent = 2 * (n - 1) / n * 4 * numel / (1 if v.kind == "ddp" else v.period)
    return {"variant": name, "seed": seed, "schedule": args.schedule,
            "num_samples": args.num_samples, "curve": curve, "final": accs[marks[-1]],
            "best": accs[best], "best_step": best, "bytes_per_step": sent,
            "seconds": time.perf_counter() - t0}


def steps_to(result: dict, target: float) -> int | None:
    """The first mark at which ``result``'s average model reached ``target`` accuracy."""
    return next((int(m) for m, c in sorted(result["curve"].items(), key=lambda kv: int(kv[0]))
                 if c["acc"] >= target), None)


def summarize(results: list[dict], variants: list[str], marks: list[int],
              target: float = 0.65) -> str:
    """A markdown table: per variant the median accuracy at each mark, final, best (step),
    the consensus distance at the last mark, the steps to ``target`` (the first mark that
    reached it; "never" when the median run did not) and the bytes a member sent per step."""
    rows = ["| variant | " + " | ".join(str(m) for m in marks)
            + f" | final | best (step) | drop | consensus at end | steps to {100 * target:g}% "
              "| kB / step |",
            "|---|" + "---|" * (len(marks) + 6)]
    for name in variants:
        rs = [r for r in results if r["variant"] == name]
        if not rs:
            continue
        med = [statistics.median(r["curve"][m]["acc"] for r in rs) for m in marks]
        final = statistics.median(r["final"] for r in rs)
        best = statistics.median(r["best"] for r in rs)
        step = statistics.median(r["best_step"] for r in rs)
        cons = statistics.median(r["curve"][marks[-1]]["consensus"] for r in rs)
        finals = [100 * r["final"] for r in rs]
        spread = f" [{min(finals):.1f}-{max(finals):.1f}]"
        # "never" counts as past every mark: the median is a step only if most runs got there
        to = sorted(steps_to(r, target) or math.inf for r in rs)[(len(rs) - 1) // 2]
        kb = statistics.median(r["bytes_per_step"] for r in rs) / 1e3
        rows.append(f"| {name} | " + " | ".join(f"{100 * a:.1f}" for a in med)
                    + f" | {100 * final:.1f}{spread} | {100 * best:.1f} ({step:.0f}) | "
                    f"{100 * (best - final):.1f} | {cons:.1e} | "
                    f"{'never' if to == math.inf else to} | {kb:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="MNIST-1D trained to the end by qcomm's gossip variants and exact-average "
                    "peers in one process: final, best and the consensus distance.",
        epilog="variants: " + "; ".join(f"{k}: {v.about}" for k, v in VARIANTS.items())
               + "; and the peers' tuning grid: diloco-hH-oO-mM (DiLoCo every H steps, outer "
                 "lr O/10, momentum M/10), local-sgd-pP (the mean every P steps)")
    ap.add_argument("--variants", default="slow-link,lockstep,no-outer,local-sgd,diloco,ddp",
                    help="comma list of variants (see below).")
    ap.add_argument("--nodes", type=int, default=4, help="members, one per node (default 4).")
    ap.add_argument("--steps", type=int, default=2400, help="steps per member (default 2400).")
    ap.add_argument("--marks", default=None,
                    help="steps at which the average is evaluated (default every tenth).")
    ap.add_argument("--seeds", type=int, default=3,
                    help="seeds K..K+N-1, K from --first-seed (default 3).")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="the first seed (default 0): more seeds of a cell run before.")
    ap.add_argument("--summarize", default=None,
                    help="comma list of --json files of earlier runs (of one --nodes and "
                         "--marks): print their table, merged, and run nothing.")
    ap.add_argument("--lr", type=float, default=0.05, help="inner learning rate (0.05).")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="the learning rate: constant, or 5%% warm-up then cosine to 0 (the "
                         "cluster benchmark's --lr-schedule).")
    ap.add_argument("--num-samples", type=int, default=12000,
                    help="MNIST-1D samples generated (80%% train; default 12000, as compare.py).")
    ap.add_argument("--width", type=int, default=512, help="the MLP's width (default 512).")
    ap.add_argument("--target", type=float, default=0.65,
                    help="the accuracy whose steps the table gives (0.65; reached at the first "
                         "mark at or above it: pass fine --marks).")
    ap.add_argument("--slow-member", type=int, default=1,
                    help="the last member takes one step every K ticks (K=2: half speed; "
                         "wait-free gossip variants only); --steps counts the others'.")
    ap.add_argument("--json", default=None, help="write every run's curve here.")
    args = ap.parse_args(argv)
    variants = [s for s in args.variants.split(",") if s]
    bad = [s for s in variants if variant(s) is None]
    if bad:
        from qcomm.validation import did_you_mean

        ap.error(f"unknown variant {bad[0]!r}; known: {', '.join(VARIANTS)}, diloco-hH-oO-mM, "
                 "local-sgd-pP"
                 f"{did_you_mean(bad[0], VARIANTS)}")
    lockstep = [s for s in variants if variant(s).kind != "gossip" or not variant(s).wait_free]
    if args.slow_member < 1 or (args.slow_member > 1 and lockstep):
        ap.error(f"--slow-member must be an int >= 1, and > 1 only with wait-free gossip "
                 f"variants (got {args.slow_member} with {', '.join(lockstep) or 'none'})")
    if not 0 < args.target <= 1:
        ap.error(f"--target must be an accuracy in (0, 1], got {args.target}")
    if args.nodes < 2 or args.steps < 10 or args.seeds < 1 or args.first_seed < 0:
        ap.error("--nodes must be >= 2, --steps >= 10, --seeds >= 1, --first-seed >= 0")
    args.marks = ([int(m) for m in args.marks.split(",") if m] if args.marks
                  else [args.steps * k // 10 for k in range(1, 11)])
    if not args.marks or max(args.marks) != args.steps or min(args.marks) < 1:
        ap.error("--marks must be steps in [1, --steps] ending at --steps")
    if args.summarize:
        return summarize_files(args.summarize.split(","), variants, sorted(args.marks),
                               args.target)
    from bench.cluster import workloads as W
    from bench.common import cpu_model, load_average

    print(f"# cpu {cpu_model()}; load {load_average()}; {args.nodes} nodes; {args.steps} "
          f"steps; lr {args.lr} {args.schedule}; {args.num_samples} samples; slow member "
          f"every {args.slow_member} ticks; SLOW_LINK "
          f"{slow_link()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "mnist1d.npz"
        W.make_data("mnist1d", data, seed=0, num_samples=args.num_samples)
        for name in variants:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                r = run(name, seed, args, data)
                results.append(r)
                print(f"  {name} seed {seed}: final {100 * r['final']:.1f}%, best "
                      f"{100 * r['best']:.1f}% at {r['best_step']} ({r['seconds']:.0f} s)",
                      flush=True)
                if args.json:   # after every run: a sweep cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\naccuracy of the members' average (median of {args.seeds} seeds; final's "
          "[min-max]); drop: best - final in points")
    print(summarize(results, variants, sorted(args.marks), args.target))
    return 0


def summarize_files(paths: list[str], variants: list[str], marks: list[int],
                    target: float) -> int:
    """Print the table of the runs kept in ``paths`` (``--json`` files), one seed of a
    variant once; runs of variants not in ``variants`` are left out."""
    results, seen = [], set()
    for path in paths:
        for r in json.loads(Path(path).read_text()):
            key = (r["variant"], r["seed"])
            if r["variant"] in variants and key not in seen:
                seen.add(key)
                r["curve"] = {int(m): v for m, v in r["curve"].items()}   # JSON keys: str
                results.append(r)
    if not results:
        print(f"no runs of {', '.join(variants)} in {', '.join(paths)}", file=sys.stderr)
        return 2
    seeds = sorted({r["seed"] for r in results})
    print(f"accuracy of the members' average (median of seeds {seeds}; final's [min-max]); "
          "drop: best - final in points")
    print(summarize(results, variants, marks, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
