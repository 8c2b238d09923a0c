"""Where the wait-free gossip loses accuracy per step against lockstep, cause by cause.

    python bench/wait_free_causes.py --variants lockstep,wait-free,no-late
    python bench/wait_free_causes.py --qcomm OLD_CHECKOUT   # every variant, another version

``--nodes`` members train MNIST-1D's MLP (bench/cluster's ``mnist1d`` workload) in one process,
the gossip on a stepped in-memory world (:class:`~qcomm.collectives.memory.WaitFreeSimulator`;
the lockstep gossip on the same kind of world) whose clock counts ticks: the same code as over
Gloo, deterministic, no sockets. Scenarios: ``healthy``, ``latency`` (6 ticks), ``slow`` (the
last member at half speed), ``slow4``, ``slow8`` (4 and 8 times slower), ``jitter`` (1 to 11
ticks). Variants: ``lockstep``, ``wait-free`` and oracles that each remove one suspected cause,
``no-late``, ``no-outer`` (beside ``lockstep-no-outer``), ``mean-kept`` and ``matched`` (the
last two with ``--qcomm`` naming a checkout of the lagged mixing). What each scenario and
variant does: bench/README.md, "wait_free_causes.py".

Reported: the test accuracy of the members' average model when the fastest member has taken
each of ``--marks`` steps, median over ``--seeds`` seeds, and each variant's difference from
lockstep in points. The gossip settings default to the README's slow-link setting.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCENARIOS = {"healthy": {"delay": 1, "slow": 1.0}, "latency": {"delay": 6, "slow": 1.0},
             "slow": {"delay": 1, "slow": 2.0}, "slow4": {"delay": 1, "slow": 4.0},
             "slow8": {"delay": 1, "slow": 8.0}, "jitter": {"delay": (1, 11), "slow": 1.0}}
VARIANTS = ("lockstep", "wait-free", "no-late", "no-outer", "lockstep-no-outer", "mean-kept",
            "matched")
SLOW_LINK = {"bits": 2, "sync_every": 16, "fragments": 4, "gamma": 0.8, "rounding": "nearest",
             "outer_momentum": 0.9, "outer_lr": 0.5}


class Member:
    """One node's model, its parameters views of one flat float32 vector ``x`` (what the gossip
    reads and writes), and its SGD with momentum."""

    def __init__(self, work: Any, numel: int, lr: float, momentum: float) -> None:
        import torch

        self.work = work
        self.model = work.make_model()
        params = list(self.model.parameters())
        self.x = torch.zeros(numel)
        at = 0
        for p in params:
            n = p.numel()
            self.x[at:at + n].copy_(p.detach().reshape(-1))
            p.data = self.x[at:at + n].view_as(p)
            at += n
        self.opt = torch.optim.SGD(params, lr=lr, momentum=momentum)

    def step(self, i: int) -> None:
        self.opt.zero_grad()
        self.work.loss(self.model, i).backward()
        self.opt.step()


def _record_corrections(g: Any, total: Any) -> None:
    """Oracle ``mean-kept``: every mixing correction ``g`` adds to its x is also added to
    ``total`` (the caller takes the members' sum of them back after each tick)."""
    import torch

    mix = g._mix

    def recorded(x: torch.Tensor, f: int, t: int) -> None:
        frag = g.fragment(f)
        w, w_sum = g._weights_at(t, x.device)
        correction = torch.mv(g._copies[:, frag].t(), w) - w_sum * g._own_pub[frag]
        total[frag].add_(correction, alpha=g.gamma)
        mix(x, f, t)

    g._mix = recorded


def _match_copies(g: Any) -> None:
    """Oracle ``matched``: each neighbour's copy is compared with the member's own copy holding
    as many of its own rounds as the copy holds of the neighbour's, each neighbour's term once
    per new message of it (the outer step as the code takes it)."""
    import torch

    seen = [[0] * g.fragments for _ in g.peers]
    mixed = [[0] * g.fragments for _ in g.peers]
    sent: list[tuple[int, torch.Tensor]] = []
    apply_pending, end_step = g._apply_pending, g.end_step

    def counted() -> None:
        for k, msgs in enumerate(g._pending):
            for r, _ in msgs:
                seen[k][r % g.fragments] += 1
        apply_pending()

    def recorded(x: torch.Tensor | None) -> list[int]:
        before = None if g._hat_own is None else g._hat_own.clone()
        t = g.rounds_started
        out = end_step(x)
        if before is not None and x is not None and g.rounds_started > t:
            sent.append((t, g._hat_own - before))
            del sent[:-64]
        return out

    def mix(x: torch.Tensor, f: int, t: int) -> None:
        frag = g.fragment(f)
        xf = x[frag]
        if g._outer:
            a, u = g._anchor[frag], g._momentum[frag]
            d = torch.sub(xf, a)
            u.mul_(g.outer_momentum).add_(d)
            d.add_(u, alpha=g.outer_momentum)
            torch.add(a, d, alpha=g.outer_lr, out=xf)
        correction = torch.zeros(frag.stop - frag.start)
        for k in range(len(g.peers)):
            if seen[k][f] == mixed[k][f]:
                continue
            mixed[k][f] = seen[k][f]
            own = g._hat_own[frag].clone()
            for r, d in sent:
                if r >= g.received[k]:
                    own -= d[frag]
            correction += g._edge_weight * (g._copies[k, frag] - own)
        xf.add_(correction, alpha=g.gamma)
        if g._outer:
            g._anchor[frag].copy_(xf)

    g._apply_pending, g.end_step, g._mix = counted, recorded, mix


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def run(variant: str, scenario: str, seed: int, args: argparse.Namespace, data: Path) -> dict:
    """One run: the members' average model's accuracy at each mark of the fastest member."""
    import torch

    from bench.cluster import workloads as W
    from qcomm.collectives.gossip.choco import CompressedGossip
    from qcomm.collectives.memory import MemoryWorld, WaitFreeSimulator
    from qcomm.compress import QuantSpec

    torch.set_num_threads(1)
    info = W.WORKLOADS["mnist1d"]
    shape = SimpleNamespace(width=args.width, depth=info.depth)
    comm = dict(SLOW_LINK)
    if variant in ("no-outer", "lockstep-no-outer"):
        comm.update(outer_momentum=0.0, outer_lr=1.0)
    sc = SCENARIOS[scenario]
    n = args.nodes
    periods = [1] * n
    if sc["slow"] != 1.0:
        periods[-1] = int(sc["slow"])
    delay = 1 if variant == "no-late" else sc["delay"]
    if isinstance(delay, tuple):
        draws = random.Random(seed)
        low, high = delay
        delay = lambda i, j: float(draws.randint(low, high))  # a draw per message
    lockstep = variant.startswith("lockstep")
    if lockstep:
        periods, delay = [1] * n, 1
    works = [W.load("mnist1d", data, rank=r, seed=seed, batch=info.batch,
                    total_steps=args.steps, args=shape) for r in range(n)]
    members = []
    for w in works:
        torch.manual_seed(seed)  # every member starts from the same weights
        probe = w.make_model()
        numel = _padded(sum(p.numel() for p in probe.parameters()),
                        128 * comm["fragments"])
        torch.manual_seed(seed)
        members.append(Member(w, numel, info.lr, info.momentum))
    spec = QuantSpec(comm["bits"], 128, comm["rounding"])
    gossip_kw = dict(spec=spec, gamma=comm["gamma"], fragments=comm["fragments"],
                     round_period=comm["sync_every"] // comm["fragments"],
                     outer_momentum=comm["outer_momentum"], outer_lr=comm["outer_lr"],
                     staleness=1)
    xs = [m.x for m in members]
    if lockstep:
        steps = {"t": 0}
        world = MemoryWorld(n, clock=lambda: float(steps["t"]))
        gossips = [CompressedGossip(list(range(n)), world.group(list(range(n)), i), numel,
                                    **gossip_kw) for i in range(n)]
    else:
        sim = WaitFreeSimulator(n, numel, periods=periods, delay=delay, **gossip_kw)
        gossips = sim.members
        if variant == "matched":
            for g in gossips:
                _match_copies(g)
    corrections = None
    if variant == "mean-kept":
        corrections = torch.zeros(numel)
        for g in gossips:
            _record_corrections(g, corrections)
    evaluator = works[0].make_model()
    marks = sorted(set(args.marks))
    curve: dict[int, float] = {}
    tick = 0
    t0 = time.perf_counter()
    while len(curve) < len(marks):
        for i, (m, g) in enumerate(zip(members, gossips, strict=True)):
            if tick % periods[i]:
                continue
            if not lockstep and sim._blocked(i):
                continue
            g.prepare()
            m.step(g.steps)
            g.end_step(m.x)
        tick += 1
        if lockstep:
            steps["t"] = tick
        else:
            sim.now = float(tick)
        if corrections is not None:
            # what the tick's mixing moved the members' sum by, taken back evenly
            for x in xs:
                x.sub_(corrections, alpha=1 / n)
            corrections.zero_()
        fastest = max(g.steps for g in gossips)
        if fastest in marks and fastest not in curve:
            mean = torch.stack(xs).mean(0)
            at = 0
            with torch.no_grad():
                for p in evaluator.parameters():
                    p.copy_(mean[at:at + p.numel()].view_as(p))
                    at += p.numel()
            curve[fastest] = works[0].evaluate(evaluator)
    return {"variant": variant, "scenario": scenario, "seed": seed, "curve": curve,
            "seconds": time.perf_counter() - t0,
            "steps": [g.steps for g in gossips]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Accuracy at equal steps of the wait-free gossip against lockstep, with "
                    "oracles that each remove one suspected cause of the difference.")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma list of {', '.join(SCENARIOS)} (default all).")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {', '.join(VARIANTS)} (default all).")
    ap.add_argument("--nodes", type=int, default=4, help="members, one per node (default 4).")
    ap.add_argument("--steps", type=int, default=600,
                    help="steps of the fastest member (default 600).")
    ap.add_argument("--marks", default="150,300,450,600",
                    help="steps of the fastest member at which the average is evaluated.")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3).")
    ap.add_argument("--width", type=int, default=512, help="the MLP's width (default 512).")
    ap.add_argument("--json", default=None, help="write every run's curve here.")
    ap.add_argument("--qcomm", default=None,
                    help="a checkout whose qcomm package runs instead of this one's (for "
                         "before/after comparisons).")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    bad = [s for s in scenarios if s not in SCENARIOS] + [v for v in variants
                                                         if v not in VARIANTS]
    if bad:
        # this checkout's qcomm: the run exits here, before --qcomm chooses one
        from qcomm.validation import did_you_mean

        ap.error(f"unknown scenario or variant {bad}"
                 f"{did_you_mean(bad[0], [*SCENARIOS, *VARIANTS])}")
    args.marks = [int(m) for m in args.marks.split(",") if m]
    if not args.marks or max(args.marks) > args.steps or min(args.marks) < 1:
        ap.error("--marks must be steps in [1, --steps]")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tempfile

    from bench.common import use_qcomm_from

    use_qcomm_from(args.qcomm)
    from bench.cluster import workloads as W
    from bench.common import cpu_model, load_average
    from qcomm.collectives.gossip import WaitFreeGossip

    lagged = hasattr(WaitFreeGossip, "_weights_at")   # the mixing before it was paired
    if not lagged and {"mean-kept", "matched"} & set(variants):
        ap.error("the mean-kept and matched oracles replace parts of the lagged wait-free "
                 "mixing: run them with --qcomm naming a checkout of that version")

    import qcomm

    print(f"# qcomm from {Path(qcomm.__file__).resolve().parent.parent}; cpu {cpu_model()}; "
          f"load {load_average()}; {args.nodes} nodes; {SLOW_LINK}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "mnist1d.npz"
        W.make_data("mnist1d", data, seed=0)
        for scenario in scenarios:
            for variant in variants:
                if variant.startswith("lockstep") and scenario != scenarios[0]:
                    continue   # lockstep's steps are the same in every scenario
                for seed in range(args.seeds):
                    r = run(variant, scenario, seed, args, data)
                    results.append(r)
                    print(f"  {scenario} {variant} seed {seed}: "
                          + ", ".join(f"{s}: {100 * a:.1f}%" for s, a in r["curve"].items())
                          + f" ({r['seconds']:.0f} s, steps {r['steps']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))

    def med(variant: str, scenario: str, mark: int) -> float:
        sc = scenarios[0] if variant.startswith("lockstep") else scenario
        return statistics.median(r["curve"][mark] for r in results
                                 if r["variant"] == variant and r["scenario"] == sc)

    marks = sorted(args.marks)
    for scenario in scenarios:
        print(f"\n{scenario}: accuracy of the average model at the fastest member's step "
              f"(median of {args.seeds}); in brackets, points against lockstep")
        print("| variant | " + " | ".join(str(m) for m in marks) + " |")
        print("|---|" + "---|" * len(marks))
        for variant in variants:
            ref = "lockstep-no-outer" if variant == "no-outer" and \
                "lockstep-no-outer" in variants else "lockstep"
            cells = []
            for m in marks:
                a = med(variant, scenario, m)
                diff = (f" ({100 * (a - med(ref, scenario, m)):+.1f})"
                        if ref in variants and variant != ref else "")
                cells.append(f"{100 * a:.1f}%{diff}")
            print(f"| {variant} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
