"""Sweep driver of the emulated-cluster benchmark: every method on the same workload, per
layout and inter-node rate, repeated; a table on the terminal, JSON, and PNG plots. Needs root
(netns.sh).

    sudo .venv/bin/python bench/cluster/compare.py --workload charlm --layouts 2x2 \
        --rates 300mbit --methods all

For each (layout, rate) one cluster is built (netns.sh up), every (workload, method) runs in it
``--repeats`` times (netns.sh launch: one torchrun per node), and the cluster is torn down, also
on failure or Ctrl-C. Repetitions are interleaved (every method once, then every method again),
so a change of the machine's load during the sweep hits all methods alike. Each run writes a
JSON (workload.py); this script derives from it, per run:

- median step time and samples/s, time to ``--target`` quality (test accuracy, or validation
  loss for charlm), final quality;
- inter-node bytes per step and node, counted from the namespaces' interface counters and, for
  qcomm methods, from qcomm's own stats (for torch and torchft methods: from the algorithm's
  formula); the two must agree within ``--agree`` (5%);
- the share of a step spent communicating: ``1 - compute-only step / step``;

and per cell (workload, layout, rate, method) the median over the repetitions with the min and
max beside it, and the targets for the qcomm method against ddp and the other peers (assgd-4 on
MNIST-1D, qcomm-hier-4 on charlm), met or missed and by how much.

With ``--kill-node K --kill-at F`` every process of node K dies (SIGKILL) at that fraction of
each run, and each run is classified by what the survivors did: it stops (a failed collective:
the step, the error's class, the best quality its snapshots reached), continues with the
surviving nodes, or finished (the node was not lost); time to target and final quality are the
survivors' (a method that stops counts only snapshots taken before the loss).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports and
    # the availability checks see this checkout's qcomm (what the ranks import through
    # PYTHONPATH), not an installed one.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import rejoining as J
from bench.cluster import training as T
from bench.cluster import worker_flags as F
from bench.cluster import workloads as W
from bench.cluster.project_targets import SUBJECT, check_targets
from bench.cluster.repetitions import aggregate
from bench.cluster.run_launch import (
    HERE,
    LIGHTNING,
    LINK_PORT,
    RECOVERY,
    RENDEZVOUS_PORT,
    WORKLOAD,
    launch_command,
    netns,
    run_one,
)
from bench.cluster.run_summary import (
    kill_summary,
    quality_at_steps,
    rejoin_summary,
    steps_to_target,
    summarize_run,
    time_to_target,
)
from bench.cluster.sweep_plan import Cell, Sweep
from bench.cluster.sweep_plots import plot
from bench.cluster.sweep_resume import record_args, resume_problem, reusable
from bench.cluster.sweep_summary import environment, problems, write_summary
from bench.cluster.sweep_tables import equal_steps_table, kill_table, print_tables, table
from bench.progress import note, progress

# The names the tests (and older callers) import from here, wherever they now live: one run's
# summary, the cell's row, the tables and the launch are modules of their own beside this one.
__all__ = ["FASTEST", "RECOVERY", "SUBJECT", "WORKLOAD", "Cell", "Sweep", "aggregate",
           "check_targets", "equal_steps_table", "kill_summary", "kill_table", "launch_command",
           "main", "parse_args", "parse_layout", "parse_time_budget", "quality_at_steps",
           "rate_bits_per_s", "rejoin_summary", "settings", "steps_to_target", "summarize_run",
           "table", "time_to_target", "workload_command"]

# ---------------------------------------------------------------------------------------------
# pure parts (unit-tested)


def parse_layout(s: str) -> T.Layout:
    """``"2x2"`` (nodes x procs per node) -> Layout."""
    try:
        nodes, procs = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout must look like NODESxPROCS, e.g. 2x2, got {s!r}") from None
    if nodes < 1 or procs < 1:
        raise ValueError(f"layout needs >= 1 node and >= 1 proc per node, got {s!r}")
    return T.Layout(nodes, procs)


FASTEST = "fastest"   # --time-budget: every node until the fastest took --steps steps


def parse_time_budget(s: str, layouts: str) -> dict[str, float | str]:
    """``--time-budget``: ``"fastest"`` (every node trains until the first node has taken
    ``--steps`` steps), ``"8"`` (seconds for every layout of ``layouts``) or ``"4x1=8,2x2=16"``
    (one per layout, every layout of ``layouts`` named) -> {layout tag: seconds or
    ``"fastest"``}. ValueError names what is wrong."""
    tags = [parse_layout(v).tag for v in layouts.split(",")]
    if s.strip() == FASTEST:
        return dict.fromkeys(tags, FASTEST)
    if "=" not in s:
        try:
            seconds = float(s)
        except ValueError:
            raise ValueError(f"--time-budget must be SECONDS or LAYOUT=SECONDS,..., got "
                             f"{s!r}") from None
        given = dict.fromkeys(tags, seconds)
    else:
        given = {}
        for part in s.split(","):
            tag, _, value = part.partition("=")
            try:
                lay, seconds = parse_layout(tag.strip()), float(value)
            except ValueError:
                raise ValueError(f"--time-budget must be SECONDS or LAYOUT=SECONDS,..., got "
                                 f"{part!r} in {s!r}") from None
            given[lay.tag] = seconds
        missing = [t for t in tags if t not in given]
        if missing:
            raise ValueError(f"--time-budget names no seconds for layout {', '.join(missing)} "
                             f"of --layouts {layouts}")
    bad = {t: v for t, v in given.items() if not v > 0}
    if bad:
        raise ValueError(f"--time-budget must be seconds > 0, got {bad}")
    return {t: given[t] for t in tags}


def rate_bits_per_s(rate: str) -> float:
    """tc rate (``100mbit``, ``1gbit``, ``500kbit``, ``800bit``) -> bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.endswith(unit):
            num = rate[: -len(unit)]
            if num.replace(".", "", 1).isdigit():
                return float(num) * mult
    raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


# ---------------------------------------------------------------------------------------------
# one run: its command line (run_launch.py launches it), and the driver's flags


def settings(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """What workload.py gets for ``workload``: the command line's values, the workload's
    defaults where the command line left them out."""
    info = W.WORKLOADS[workload]
    out: dict[str, Any] = {}
    for key in ("width", "depth", "batch", "lr", "momentum", "weight_decay", "steps", "target"):
        v = getattr(args, key)
        out[key] = getattr(info, key) if v is None else v
    return out


def workload_command(workload: str, method: str, args: argparse.Namespace, data: Path,
                     out_json: Path, layout: str, rep: int = 0) -> list[str]:
    """workload.py's arguments for repetition ``rep`` of one run on ``layout`` (its tag, e.g.
    ``"2x2"``: which ``--time-budget`` applies)."""
    values = {**vars(args), **settings(workload, args)}  # the workload's where left out
    if args.seed_per_repeat:
        # The data stays the sweep's (made with --seed); the run's initial weights, batches
        # and quantization draws change with each repetition.
        values["seed"] = args.seed + rep
    seconds = args.time_budget[layout] if args.time_budget else None
    if seconds == FASTEST:
        budget = ["--until-fastest"]
    else:
        budget = (["--time-budget", f"{seconds:g}"] if seconds else []) + \
            F.command_line(values, ("max_steps",))
    # A lost node that comes back: the peers' own recoveries (recovery.py).
    script = RECOVERY if recovery_run(method, args) else \
        LIGHTNING if M.is_lightning(method) else WORKLOAD
    return [str(script), "--workload", workload, "--method", method, "--data", str(data), *budget,
            "--out", str(out_json), *F.command_line(values, F.PASSED_ON)]


def recovery_run(method: str, args: argparse.Namespace) -> bool:
    """Whether this run of ``method`` is a peer's own recovery (recovery.py): a lost node comes
    back (``--join-at``) and the method is DDP or local SGD (elastic restart) or torchft's
    (streaming) DiLoCo (heal)."""
    return args.join_at is not None and M.recovers_by_itself(method)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--workload", default="mnist1d",
                   help="The workloads to train, a comma list of " + ", ".join(W.WORKLOADS) + ".")
    p.add_argument("--layouts", default="2x2,4x1",
                   help="The cluster layouts, a comma list of NODESxPROCS (e.g. 2x2,4x1).")
    p.add_argument("--rates", default="100mbit,300mbit,1gbit",
                   help="The inter-node link rates, a comma list of tc rates.")
    p.add_argument("--methods", default="all",
                   help="The methods: all, a family (torch, torchft, qcomm) or a comma list.")
    p.add_argument("--repeats", type=int, default=3,
                   help="Runs per cell; the table shows their median and [min-max].")
    p.add_argument("--seed-per-repeat", action="store_true",
                   help="Repetition r trains with seed --seed + r - 1 (initial weights, batches, "
                        "quantization draws; the data stays --seed's): the spread then "
                        "includes the seed's, which a lockstep method, the same bits in every "
                        "run of one seed, otherwise never shows.")
    # workload.py's flags, passed on to every run (declared once, in worker_flags.py)
    F.add_flags(p, ("steps", "lr_schedule", "warmup", "width", "depth", "batch", "lr",
                    "momentum", "weight_decay", "seed"))
    p.add_argument("--num-samples", type=int, default=12000,
                   help="MNIST-1D samples generated (80%% for training).")
    p.add_argument("--target", type=float, default=None,
                   help="The quality whose first reaching is the time to target; the "
                        "workload's when left out (mnist1d test accuracy 0.70, charlm "
                        "validation loss 1.90).")
    F.add_flags(p, F.METHOD_SETTINGS)
    p.add_argument("--delay-ms", type=float, default=None,
                   help="One-way latency between nodes, ms: the nodes are joined by the "
                        "delayline forwarder (netns.sh) instead of the bridge. Left out: the "
                        "bridge, no latency.")
    p.add_argument("--slow-nodes", type=int, default=0,
                   help="Slow the last K nodes of every layout down with a CPU cap (a cgroup "
                        "quota, see netns.sh); 0: every node at full speed.")
    p.add_argument("--equal-cpu", action="store_true",
                   help="Cap every node at cores / nodes of this machine's CPU (identical "
                        "machines: no node takes another's share); with --slow-nodes, a slow "
                        "node at 1 / --slowdown of that.")
    p.add_argument("--slowdown", type=float, default=2.0,
                   help="How much slower a slow node computes: 2 is half speed.")
    p.add_argument("--time-budget", default=None,
                   help="How long the methods whose nodes may take different numbers of steps "
                        "(qcomm variants ending in -wf or -cont) train; the others take --steps "
                        "steps. 'fastest': every node until the first node has taken --steps "
                        "steps (the fastest node does a lockstep run's work, on any machine); "
                        "SECONDS per node for every layout, or LAYOUT=SECONDS,... one per "
                        "layout (e.g. 4x1=8,2x2=16).")
    # unset: a healthy sweep passes no timeout on (and its summary records none)
    F.add_flags(p, ("max_steps", "kill_node", "kill_at", "join_at", "pg_timeout", "fsdp",
                    "links"), unset=("pg_timeout",))
    p.add_argument("--timeout", type=int, default=900, help="The seconds allowed per run.")
    p.add_argument("--resume", action="store_true",
                   help="Take up the sweep in --out: the runs whose JSON is there are read, "
                        "not run again; the others run. The settings must be the first "
                        "invocation's (--timeout, --repeats and the report's flags may change).")
    p.add_argument("--agree", type=float, default=0.05,
                   help="Largest relative difference allowed between the two byte counts.")
    p.add_argument("--out", default="",
                   help="The output directory (default: bench/out/cluster/<time>).")
    p.add_argument("--strict", action="store_true",
                   help="Exit 1 unless every applicable, available run finished and bytes "
                        "agree.")
    p.add_argument("--no-plots", action="store_true", help="Write no PNG plots.")
    F.add_flags(p, ("profile",))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.resume and not args.out:
        p.error("--resume takes up the sweep in --out DIR: name it")
    check_kill(p, args)
    if args.fsdp and (args.kill_node is not None or args.time_budget is not None):
        p.error("--fsdp runs are healthy and take --steps steps: it cannot be combined with "
                "--kill-node or --time-budget")
    if args.links != "world" and (args.kill_node is not None or args.fsdp):
        p.error(f"--links {args.links} runs healthy nodes linked through the rendezvous: it "
                "cannot be combined with --kill-node or --fsdp")
    if args.time_budget is not None:
        try:
            args.time_budget = parse_time_budget(args.time_budget, args.layouts)
        except ValueError as e:
            p.error(str(e))
    if args.pg_timeout is not None and args.pg_timeout <= 0:
        p.error(f"--pg-timeout must be a number of seconds > 0, got {args.pg_timeout:g}")
    if args.join_at is not None:
        seconds = args.time_budget is not None and all(
            v != FASTEST for v in args.time_budget.values())
        for name in M.parse_methods(args.methods):
            problem = J.join_problem(name, args.kill_at, args.join_at, seconds)
            if problem:
                p.error(problem)
    return args


def check_kill(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kill-node and --kill-at: both or neither; a node other than 0 that every layout has;
    a fraction strictly inside the run."""
    if (args.kill_node is None) != (args.kill_at is None):
        p.error("--kill-node and --kill-at go together (which node is lost, and when)")
    if args.kill_node is None:
        return
    if args.kill_node < 1:
        p.error(f"--kill-node must be 1 or more: node 0 hosts the rendezvous store "
                f"(torchrun's, and torchft's lighthouse), got {args.kill_node}")
    try:
        layouts = [parse_layout(v) for v in args.layouts.split(",")]
    except ValueError as e:
        p.error(str(e))
    short = [lay.tag for lay in layouts if args.kill_node >= lay.nodes]
    if short:
        p.error(f"--kill-node {args.kill_node} is not a node of layout {', '.join(short)} "
                f"(nodes are numbered from 0)")
    if not 0 < args.kill_at < 1:
        p.error(f"--kill-at must be a fraction strictly between 0 and 1, got {args.kill_at:g}")


# ---------------------------------------------------------------------------------------------
# the sweep


def plan(args: argparse.Namespace) -> Sweep:
    """The command line's lists, checked (ValueError names a bad one), and the output
    directory, made."""
    workloads = W.parse_workloads(args.workload)
    layouts = [parse_layout(s) for s in args.layouts.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        rate_bits_per_s(r)
    names = M.parse_methods(args.methods)
    stuck = [n for n in names if args.links != "world" and not M.continues_after_loss(n)]
    if stuck:
        raise SystemExit(f"compare.py: --links {args.links} links the nodes through qcomm's "
                         f"rendezvous, which needs methods that continue without a lost node "
                         f"(names ending in -cont, slow-link); not {', '.join(stuck)}")
    outdir = Path(args.out or HERE.parent / "out" / "cluster" / time.strftime("%Y%m%d-%H%M%S"))
    (outdir / "runs").mkdir(parents=True, exist_ok=True)
    return Sweep(workloads, layouts, rates, names, outdir)


def announce(args: argparse.Namespace, env: dict[str, Any]) -> None:
    """The environment, and what about this sweep a reader of its table should know first."""
    print(f"environment: {json.dumps(env)}")
    if args.repeats < 3:
        print(f"repeats: {args.repeats} (fewer than 3: the spread columns say little)")
    if args.kill_node is not None and args.join_at is not None:
        print(f"lost node that comes back: node {args.kill_node}'s ranks are killed (SIGKILL) at "
              f"{args.kill_at:g} x time budget, its torchrun starts them again, and they join "
              f"the running nodes at {args.join_at:g} x time budget (nodes linked through "
              "qcomm's rendezvous)")
    elif args.kill_node is not None:
        print(f"lost node: node {args.kill_node} is killed (SIGKILL, every process) after step "
              f"round({args.kill_at:g} x steps), or at {args.kill_at:g} x time budget for "
              "per-node budgets")


def make_data(sweep: Sweep, args: argparse.Namespace) -> None:
    """Each workload's data file (one for every run of the sweep) and its quality target."""
    for w in sweep.workloads:
        sweep.data[w] = sweep.outdir / f"{w}.npz"
        sweep.data_info[w] = W.make_data(w, sweep.data[w], seed=args.seed,
                                         num_samples=args.num_samples)
    sweep.targets = {w: settings(w, args)["target"] for w in sweep.workloads}


def run_sweep(sweep: Sweep, args: argparse.Namespace) -> dict[Cell, list[dict[str, Any]]]:
    """Every run: per (layout, rate) one cluster, built, used for every repetition of every
    (workload, method), and removed, also on failure, Ctrl-C or SIGTERM. Returns each cell's
    repetitions. Progress on stderr (:func:`bench.progress.progress`: bars on a terminal)."""

    # SIGTERM (e.g. from a CI timeout) must run the `finally` that removes the cluster.
    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    netns("clean")
    reps: dict[Cell, list[dict[str, Any]]] = {}
    overall = progress(len(sweep.combos) * len(sweep.workloads) * len(sweep.names)
                       * args.repeats, "runs", position=0, leave=True)
    for lay, rate in sweep.combos:
        cluster = secrets.token_hex(3)
        tag = lay.tag
        try:
            netns("up", "--id", cluster, "--nodes", str(lay.nodes), "--rate", rate,
                  "--owner", str(os.getpid()),
                  *(["--delay-ms", f"{args.delay_ms:g}"] if args.delay_ms is not None else []),
                  *firewall_args(args.links, lay))
            # Repetitions interleaved: every method once, then every method again.
            for rep in range(args.repeats):
                for w in sweep.workloads:
                    for name in sweep.names:
                        cell = (w, tag, rate, name)
                        overall.set_description(f"{w} {tag} {rate} {name} #{rep + 1}")
                        row = run_cell(sweep, args, cluster, lay, cell, rep)
                        if row is not None:
                            reps.setdefault(cell, []).append(row)
                        overall.update(1)
        finally:
            netns("down", "--id", cluster, check=False)
    overall.close()
    return reps


def firewall_args(links: str, layout: T.Layout) -> list[str]:
    """netns.sh up's firewall for ``--links sockets``: every node lets in only its links' ports
    (one per rank), node 0 the rendezvous's port too; nothing for the other links."""
    if links != "sockets":
        return []
    ports = ",".join(str(LINK_PORT + r) for r in range(layout.procs))
    return ["--firewall", ports, "--firewall0", str(RENDEZVOUS_PORT)]


def run_cell(sweep: Sweep, args: argparse.Namespace, cluster: str,
             layout: T.Layout, cell: Cell, rep: int) -> dict[str, Any] | None:
    """Repetition ``rep`` of ``cell`` on the cluster: the run's row (summarized), or why it
    failed; for a method that cannot run here, why, in the first repetition only (None in the
    others)."""
    w, tag, rate, name = cell
    base = {"method": name, "workload": w, "layout": tag, "rate": rate}
    ok, why = M.applicability(name, w, args.fsdp)
    if ok:
        ok, why = M.availability(name)
    if not ok:
        return {**base, "status": why} if rep == 0 else None
    stem = f"{w}_{tag}_{rate}_{name}_r{rep + 1}"
    out_json = sweep.outdir / "runs" / f"{stem}.json"
    kept = reusable(out_json, args.resume)
    if kept is not None:
        note(f"{stem}: kept from the first invocation ({out_json})")
        return {**summarize_run(kept, sweep.targets[w]), "rate": rate}
    cmd = workload_command(w, name, args, sweep.data[w], out_json, tag, rep)
    with progress(settings(w, args)["steps"], f"  {name}", position=1, leave=False) as bar:
        rc, tail = run_one(cluster, layout, cmd, args.timeout, out_json,
                           sweep.outdir / "runs" / f"{stem}.log", bar,
                           (args.slow_nodes, args.slowdown), args.kill_node,
                           args.equal_cpu, args.join_at is not None, args.links)
    if rc != 0 or not out_json.exists():
        note(f"{stem}: FAILED (exit {rc}); log {sweep.outdir}/runs/{stem}.log\n{tail}")
        return {**base, "status": f"failed (exit {rc})"}
    row = summarize_run(json.loads(out_json.read_text()), sweep.targets[w])
    if row["capped_nodes"]:
        note(f"{stem}: WARNING node(s) {row['capped_nodes']} stopped at --max-steps "
             f"({args.max_steps or 100 * settings(w, args)['steps']} steps) before their time "
             f"budget ended: the budget did not decide this run's end; raise --max-steps")
    return {**row, "rate": rate}


# ---------------------------------------------------------------------------------------------
# the report (the tables: sweep_tables.py; summary.json: sweep_summary.py; plots: sweep_plots.py)


def print_targets(rows: Sequence[dict[str, Any]], sweep: Sweep) -> dict[str, list[dict]]:
    """The targets judged per (workload, layout, rate), printed; returned by group name."""
    checks = {}
    for w in sweep.workloads:
        for lay, rate in sweep.combos:
            tag = lay.tag
            group = [r for r in rows
                     if r.get("workload") == w and r["layout"] == tag and r["rate"] == rate]
            checks[f"{w} {tag} {rate}"] = c = check_targets(group, SUBJECT[w])
            print(f"\ntargets, {w} {tag} at {rate} (target {W.WORKLOADS[w].metric} "
                  f"{sweep.targets[w]}):")
            for t in c:
                mark = {True: "met", False: "MISSED", None: "n/a"}[t["ok"]]
                val = "-" if t["value"] is None else f"{t['value']:.3f}"
                print(f"  {t['name']:<36} {mark:<7} value {val:<9} need {t['need']}")
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("compare.py: needs root (netns.sh creates network namespaces, a bridge and tc "
              "qdiscs); run it as root or with sudo", file=sys.stderr)
        return 1
    sweep = plan(args)
    if args.resume:
        problem = resume_problem(args, parse_args(["--out", args.out]), sweep.outdir)
        if problem:
            print(f"compare.py: {problem}", file=sys.stderr)
            return 2
    record_args(args, sweep.outdir)
    env = environment()
    announce(args, env)
    make_data(sweep, args)
    reps = run_sweep(sweep, args)
    rows = [{**aggregate(cell_reps), "rate": cell[2]} for cell, cell_reps in reps.items()]
    print_tables(rows, args)
    checks = print_targets(rows, sweep)
    bad_bytes, failed = problems(rows, args)
    summary = write_summary(sweep, args, env, rows, checks, bad_bytes, failed)
    if not args.no_plots:
        for p in plot(rows, sweep.outdir, sweep.targets):
            print(f"plot: {p}")
    print(f"json: {summary}")
    if bad_bytes:
        print(f"bytes disagree by more than {100 * args.agree:.0f}% for "
              f"{[r['method'] for r in bad_bytes]}")
    if args.strict and (failed or bad_bytes):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
