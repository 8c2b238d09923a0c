"""One rank of the cluster benchmark: one workload, one method, a timed window of steps.

Run under torchrun (one torchrun per emulated node, see netns.sh); compare.py builds the command.
The workload (workloads.py) is MNIST-1D with an MLP and SGD, or a character transformer on
Python's stdlib source with AdamW. Every method gets the same model, initial weights, per-rank
batches, batch size, optimizer and step budget. What happens on each rank:

Each rank, in order: (1) a compute-only baseline; (2) ``--warmup`` untimed steps; (3) a barrier,
the byte counters read; (4) the timed ``--steps`` (or ``--time-budget`` seconds per node, or
until the first node has taken ``--steps`` with ``--until-fastest``), keeping ``--snapshots`` of
the node's parameters; (5) traffic completed, counters read again; (6) the final model made, it
and every snapshot evaluated by rank 0, one JSON with every rank's numbers written to ``--out``.
Progress goes to stdout as ``QCB_PROGRESS <done> <total>`` lines (rank 0), for compare.py's bar.

A lost node (``--kill-node K --kill-at F``): every process of node K is killed with SIGKILL
after step ``round(F * steps)`` (or ``F * time_budget`` seconds); the survivors end without any
collective over all ranks. Each step in detail, and how the survivors end:
bench/cluster/README.md, "workload.py".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    # torchrun runs this file by path (netns.sh): the repository root first on sys.path, so
    # that `bench.cluster` imports, and this checkout's qcomm with it.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import rejoining as J
from bench.cluster import sharding as S
from bench.cluster import training as T
from bench.cluster import worker_flags as F
from bench.cluster import workloads as W

# Steps between the votes of a node's ranks on stopping a per-node run (timed_steps).
STOP_CHECK_EVERY = 4


def _method_name(name: str) -> str:
    if name not in M.METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}{M.near_miss(name)}")
    return name


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


def read_tcp_retransmits() -> int:
    """TCP segments retransmitted so far by this network namespace (/proc/net/snmp is per
    namespace): resent bytes count in tx_bytes but in no algorithm's formula."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the nodes' state dicts (floating tensors; others: node 0's)."""
    out = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            out[key] = torch.stack([st[key] for st in states]).mean(dim=0)
        else:
            out[key] = first
    return out


# (step, seconds since the window opened, parameters)
Snapshot = tuple[int, float, dict[str, torch.Tensor]]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def rank_record(rank: int, node: int, local_rank: int, steps: int, step_times: list[float],
                fwd_bwd: list[float], opt_times: list[float], base_times: list[float],
                t_loop: float, t_window: float, counters: tuple | None, retrans: tuple | None,
                stats: tuple | None) -> dict[str, Any]:
    """One rank's numbers for the JSON. ``counters``, ``retrans`` and ``stats`` are the
    (window opened, window closed) readings, or None where this rank reads none. A rank that
    stopped before its first timed step has no step times (those fields are None)."""
    med = _median(step_times)
    return {
        "rank": rank, "node": node, "local_rank": local_rank, "steps": steps,
        "step_median_s": med,
        "step_mean_s": statistics.fmean(step_times) if step_times else None,
        # Stalls: the longest step, and when the long ones (over 10x the median) happened.
        "step_max_s": max(step_times) if step_times else None,
        "long_steps": [(i, round(t, 4)) for i, t in enumerate(step_times)
                       if t > 10 * med][:50] if step_times else [],
        "fwd_bwd_median_s": _median(fwd_bwd),
        "opt_step_median_s": _median(opt_times),
        "baseline_median_s": _median(base_times),
        "loop_s": t_loop, "window_s": t_window,
        "iface_tx_bytes": None if counters is None else counters[1][0] - counters[0][0],
        "iface_rx_bytes": None if counters is None else counters[1][1] - counters[0][1],
        "iface_tx_packets": None if counters is None else counters[1][2] - counters[0][2],
        "tcp_retrans_segs": None if retrans is None else retrans[1] - retrans[0],
        "qcomm_bytes": None if stats is None else
        {k: stats[1][k] - stats[0][k] for k in stats[1]},
    }


def evaluate_curve(work, per_node: list[list[Snapshot | None]]) -> list[dict[str, float]]:
    """The snapshots of several nodes -> the curve: at each mark, the average of the nodes'
    parameters evaluated, timed at the latest of the nodes' snapshot times."""
    evaluator = work.make_model()
    metric = work.info.metric
    curve = []
    for i in range(max(len(snaps) for snaps in per_node)):
        # A node that stopped before this mark (--max-steps) counts with its last snapshot; a
        # node that came back (--join-at) has None at the marks before its return.
        points = [snaps[min(i, len(snaps) - 1)] for snaps in per_node]
        points = [p for p in points if p is not None]
        if not points:
            continue
        evaluator.load_state_dict(average_states([st for _, _, st in points]))
        curve.append({"step": statistics.fmean(p[0] for p in points),
                      "fastest_step": max(p[0] for p in points),
                      "time_s": max(p[1] for p in points),
                      metric: work.evaluate(evaluator)})
    return curve


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON to ``path``, atomically (a reader sees the whole file or none)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def node_processes() -> list[int]:
    """Every process of this rank's node but itself: its torchrun agent (the parent) first,
    then every descendant of the agent (the node's other ranks). Empty when the parent is not
    torchrun (never a process outside the node's launch)."""
    me, agent = os.getpid(), os.getppid()
    try:
        cmd = Path(f"/proc/{agent}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return []
    if "torchrun" not in cmd and "torch.distributed.run" not in cmd:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [agent], [agent]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return [pid for pid in out if pid != me]


def kill_this_node(marker: Path, what: dict[str, Any], *, agent: bool = True) -> NoReturn:
    """The node is lost: write ``what`` (when, by whom) to ``marker`` for the survivors' record,
    then SIGKILL the node's torchrun agent (unless ``agent`` is False: it then starts the ranks
    again, ``--join-at``), its other ranks and this process. No cleanup of any kind: the kernel
    closes the sockets, as when a machine dies."""
    write_json(marker, what)
    pids = node_processes()
    for pid in pids if agent else pids[1:]:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL cannot be caught


def cut_connections() -> int:
    """Shut every connected socket of this process down (each peer gets end-of-stream; the
    descriptors stay open, so Gloo's bookkeeping stays valid) and return how many. A rank that
    stopped calls it: a survivor blocked on a receive from this rank fails at once instead of
    at the process group's timeout (Gloo does not fail an operation waiting on one peer when
    another peer's connection breaks, and ``abort()`` of a Gloo group closes nothing).
    Listening sockets are left alone: Gloo's listener aborts the process when its socket is
    shut down."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass  # not connected, or not a TCP socket
        finally:
            sock.detach()  # the descriptor stays its owner's
    return n


def stop_record(exc: BaseException, where: str, step: int) -> dict[str, Any]:
    """What a stopped rank records: where (``step``, ``flush``, ``finalize``, ...) and at
    which step it stopped, the exception's class name and its message's first line."""
    lines = str(exc).strip().splitlines()
    return {"type": type(exc).__name__, "message": lines[0] if lines else "", "where": where,
            "step": step}


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


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command line as the JSON records it (the kill options only when given)."""
    return {k: v for k, v in vars(args).items()
            if k != "out" and not (k in ("kill_node", "kill_at", "join_at") and v is None)}


@dataclass(frozen=True)
class Place:
    """Where this rank runs: its rank in the world, its node and its rank there, the layout,
    and the interface that carries its node's traffic to the other nodes."""

    rank: int
    world: int
    node: int
    local_rank: int
    layout: T.Layout
    iface: str

    @property
    def keeps_snapshots(self) -> bool:
        """Whether this rank keeps its node's snapshots: one per node, the node's ranks hold
        the same model."""
        return self.local_rank == 0


@dataclass
class Timed:
    """What a rank's timed window recorded.

    Attributes:
        steps: the steps it completed.
        step_times, fwd_bwd, opt_times: per step, seconds of the whole step, of forward and
            backward, and of the optimizer step.
        snapshots: ``(step, seconds since the window opened, parameters)``, on the rank that
            keeps its node's snapshots; None at the marks before a node came back.
        t_open: ``time.perf_counter()`` when the window opened.
        t_loop: seconds from the window's opening to the end of the training loop.
        stop: where and why the rank stopped (:func:`stop_record`), when a lost node made its
            communication fail; else None.
        step_ends: ``time.time()`` at the end of each step (for what a join costs).
    """

    steps: int
    step_times: list[float]
    fwd_bwd: list[float]
    opt_times: list[float]
    snapshots: list[Snapshot | None]
    t_open: float
    t_loop: float
    stop: dict[str, Any] | None
    step_ends: list[float] = field(default_factory=list)


# The byte counters read when the window opens (and again when it closes): the node's
# interface (tx bytes, rx bytes, tx packets) and TCP retransmits, read by the node's local
# rank 0 when there are other nodes (else None), and the method's own counters (or None).
Readings = tuple[tuple[int, int, int] | None, int | None, dict[str, int] | None]


def end_after_kill(args: argparse.Namespace, work, built: T.Built, here: Place, timed: Timed,
                   start: Readings, base_times: list[float], kill: dict[str, Any],
                   marker: Path, model: tuple[int, list],
                   timeline: dict[str, float] | None = None) -> NoReturn:
    """The end of a run in which a node is lost (every rank but the lost node's): no
    collective over all ranks, files instead.

    A rank that got through the timed steps completes its traffic, makes the final model and
    closes, as in a healthy run; an error on the way makes it a stopped rank too. A stopped
    rank drops its connections at once (:func:`cut_connections`). Each node's local rank 0
    saves its snapshots (and, when it finished, its final parameters); every rank writes its
    record to ``OUT.rank<r>.json`` and leaves, except rank 0, which waits for the records of
    every rank not killed (at most the longest any communication may block, plus two
    minutes), evaluates the surviving nodes' snapshots and final parameters and writes the
    JSON. With ``--join-at`` the record also holds the wall-clock end of every step and, on
    the ranks that came back, their ``timeline``, and rank 0 waits for every rank."""
    counters0, retrans0, stats0 = start
    counters1 = retrans1 = stats1 = None
    live = pace = None
    stop = timed.stop
    where = "flush"
    if stop is None:
        try:
            built.flush()
            if counters0 is not None:
                counters1, retrans1 = read_iface_bytes(here.iface), read_tcp_retransmits()
            stats1 = built.comm_stats()
            where = "context exit"
            built.context.__exit__(None, None, None)
            where = "finalize"
            built.finalize()
            live, pace = built.live_nodes(), built.pace()
            where = "close"
            built.close()
        except Exception as exc:
            stop = stop_record(exc, where, timed.steps)
    if stop is not None:
        cut_connections()
        if counters0 is not None and counters1 is None:
            counters1, retrans1 = read_iface_bytes(here.iface), read_tcp_retransmits()
        if stats0 is not None and stats1 is None:
            try:
                stats1 = built.comm_stats()
            except Exception:  # a stopped method's counters may be gone
                stats1 = None
    t_window = time.perf_counter() - timed.t_open
    rec = rank_record(here.rank, here.node, here.local_rank, timed.steps, timed.step_times,
                      timed.fwd_bwd, timed.opt_times, base_times, timed.t_loop, t_window,
                      None if counters0 is None else (counters0, counters1),
                      None if retrans0 is None else (retrans0, retrans1),
                      None if stats0 is None or stats1 is None else (stats0, stats1))
    rec["status"] = "finished" if stop is None else "stopped"
    if stop is not None:
        rec["error"] = stop
    if live is not None:
        rec["live_nodes"] = live
    if pace is not None:
        rec.update(pace)
    if args.join_at is not None:
        rec["step_ends"] = timed.step_ends
        rec["timeline"] = timeline
    if here.keeps_snapshots:
        torch.save(timed.snapshots, Path(f"{args.out}.node{here.node}.snapshots"))
        if stop is None:
            torch.save(built.module.state_dict(), Path(f"{args.out}.node{here.node}.final"))
    write_json(Path(f"{args.out}.rank{here.rank}.json"), rec)
    if here.rank == 0:
        assemble_after_kill(args, work, built, kill, marker, here.layout, model)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assemble_after_kill(args: argparse.Namespace, work, built: T.Built, kill: dict[str, Any],
                        marker: Path, layout: T.Layout, model: tuple[int, list]) -> None:
    """Rank 0 after a lost node: the records of the other ranks (waited for, with a
    deadline), the surviving nodes' snapshots averaged into the curve, the final quality
    (the surviving nodes' final parameters averaged when every survivor finished, else the
    last snapshot's), one JSON."""
    procs, world = layout.procs, layout.world
    records = {r: Path(f"{args.out}.rank{r}.json") for r in range(world)}

    comes_back = args.join_at is not None

    def accounted(r: int) -> bool:
        return records[r].exists() or (
            not comes_back and r // procs == kill["node"] and marker.exists())

    deadline = time.monotonic() + max(args.pg_timeout, 300.0) + 120.0
    while not all(accounted(r) for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = json.loads(marker.read_text()) if marker.exists() else None
    lost = {killed["node"]} if killed and not comes_back else set()
    ranks = [json.loads(f.read_text()) for r, f in records.items() if f.exists()]
    missing = [r for r, f in records.items() if not f.exists() and r // procs not in lost]
    metric = work.info.metric
    per_node, finals = [], []
    for n in range(layout.nodes):
        if n in lost:
            continue
        snap, fin = Path(f"{args.out}.node{n}.snapshots"), Path(f"{args.out}.node{n}.final")
        if snap.exists():
            per_node.append(torch.load(snap, weights_only=True))
        if fin.exists():
            finals.append(torch.load(fin, weights_only=True))
    curve = evaluate_curve(work, per_node) if per_node else []
    survivors = layout.nodes - len(lost)
    if (not missing and all(r["status"] == "finished" for r in ranks)
            and len(finals) == survivors):
        evaluator = work.make_model()
        evaluator.load_state_dict(average_states(finals))
        final, final_from = work.evaluate(evaluator), "final parameters"
    else:
        final = curve[-1][metric] if curve else None
        final_from = "last snapshot"
    numel, shapes = model
    result = {
        "method": args.method,
        "workload": args.workload,
        "metric": {"name": metric, "goal": work.info.goal},
        "layout": {"nodes": layout.nodes, "procs": procs, "world": world},
        "model": {**work.model_config, "params": numel, "shapes": shapes},
        "data": work.data_config,
        "config": run_config(args),
        f"final_{metric}": final,
        "curve": curve,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "notes": built.notes,
        "kill": {**kill, "happened": killed is not None,
                 "killed_at_step": None if killed is None else killed["step"],
                 "killed_at_s": None if killed is None else killed["time_s"]},
        "nodes": [{"node": n, "killed": n in lost} for n in range(layout.nodes)],
        "final_from": final_from,
        "missing_ranks": missing,
    }
    if comes_back:
        result["rejoin"] = {"at": args.join_at, **(J.join_summary(
            ranks, None if killed is None else killed.get("time"), kill["node"]) or {})}
    write_json(Path(args.out), result)
    for n in range(layout.nodes):
        for suffix in ("snapshots", "final"):
            Path(f"{args.out}.node{n}.{suffix}").unlink(missing_ok=True)
    for f in records.values():
        f.unlink(missing_ok=True)
    marker.unlink(missing_ok=True)
    J.window_file(args.out).unlink(missing_ok=True)
    shown = "-" if final is None else f"{final:.4f}"
    print(f"QCB_DONE {args.method} final {metric}={shown} (node {kill['node']} "
          f"{'killed' if killed else 'not killed'}, {final_from})", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--method", required=True, type=_method_name,
                   help=f"The method to train with: one of {list(M.METHODS)}, or a qcomm "
                        "variant such as assgd-4-h8f4 (methods.py explains the names).")
    p.add_argument("--workload", default="mnist1d", choices=list(W.WORKLOADS),
                   help="What to train: MNIST-1D with an MLP and SGD, or the character "
                        "transformer with AdamW.")
    p.add_argument("--data", required=True,
                   help="The workload's data file, an npz written by compare.py.")
    p.add_argument("--out", required=True, help="The JSON file rank 0 writes.")
    # the flags compare.py and ddp_reference.py take too: declared once, in worker_flags.py
    F.add_flags(p, ("width", "depth", "heads", "context", "eval_windows", "batch", "lr",
                    "momentum", "weight_decay", "steps", "lr_schedule", "warmup",
                    "baseline_steps", "snapshots", "seed", "powersgd_rank", "localsgd_period",
                    "diloco_sync_every", "streaming_fragments", "streaming_delay"))
    p.add_argument("--time-budget", type=float, default=None,
                   help="Seconds of training per node for methods whose nodes may take "
                        "different numbers of steps (wait-free gossip, names ending in -wf); "
                        "other methods take --steps steps on every rank. Left out: every "
                        "method takes --steps steps.")
    F.add_flags(p, ("max_steps",))
    p.add_argument("--until-fastest", action="store_true",
                   help="Instead of --time-budget: every node of a method whose nodes may take "
                        "different numbers of steps trains until the first node has taken "
                        "--steps steps (the same work as a lockstep run, for the fastest node).")
    F.add_flags(p, ("pg_timeout", "kill_node", "kill_at", "join_at", "fsdp", "profile"))
    args = p.parse_args(argv)
    if (args.kill_node is None) != (args.kill_at is None):
        p.error("--kill-node and --kill-at go together")
    if args.kill_node is not None and args.kill_node < 1:
        p.error(f"--kill-node must be 1 or more (node 0 hosts the rendezvous store), got "
                f"{args.kill_node}")
    if args.kill_at is not None and not 0 < args.kill_at < 1:
        p.error(f"--kill-at must be a fraction in (0, 1), got {args.kill_at}")
    if args.until_fastest and args.time_budget is not None:
        p.error("--until-fastest and --time-budget are two ways to end a per-node run: "
                "give one")
    if args.join_at is not None:
        problem = J.join_problem(args.method, args.kill_at, args.join_at,
                               args.time_budget is not None)
        if problem:
            p.error(problem)
        if M.recovers_by_itself(args.method):
            p.error(f"--join-at with {args.method}: its own recovery (torchrun's elastic "
                    f"restart, or torchft's heal) runs in bench/cluster/recovery.py, which "
                    f"compare.py launches for it")
    if args.fsdp:
        problem = fsdp_problem(args)
        if problem:
            p.error(problem)
    info = W.WORKLOADS[args.workload]
    for key in ("width", "depth", "batch", "lr", "momentum", "weight_decay", "steps"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(info, key))
    if not args.snapshots:
        args.snapshots = 30 if args.workload == "charlm" else 60
    return args


def fsdp_problem(args: argparse.Namespace) -> str | None:
    """Why ``--fsdp`` cannot run with the rest of the command line, or None: the method needs a
    sharded form (methods.sharded_form); a sharded run is healthy and takes --steps steps (its
    snapshots are collectives of a node's ranks, at steps they all take)."""
    ok, why = M.applicability(args.method, args.workload, fsdp=True)
    if not ok:
        return f"--method {args.method}: {why}"
    clash = [flag for flag, on in (("--kill-node", args.kill_node is not None),
                                   ("--join-at", args.join_at is not None),
                                   ("--time-budget", args.time_budget is not None),
                                   ("--until-fastest", args.until_fastest)) if on]
    if clash:
        return (f"--fsdp cannot be combined with {', '.join(clash)}: a sharded run is healthy "
                "and takes --steps steps on every rank")
    return None


def find_place(seat: Any = None, nodes: int | None = None) -> Place:
    """This rank's place, from the process group and torchrun's environment; for linked nodes
    (``seat`` from :func:`rejoining.init_linked`, the job's ``nodes``) from the seat: the
    default group is then the node."""
    iface = os.environ.get("QCB_IFACE", "qceth0")
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if seat is not None and nodes is not None:
        return Place(seat.rank, nodes * procs, seat.node, local_rank, T.Layout(nodes, procs),
                     iface)
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", str(rank // procs)))
    return Place(rank, world, node, local_rank, T.Layout(world // procs, procs), iface)


def method_config(args: argparse.Namespace, layout: T.Layout, optimizer: str) -> T.Config:
    """What every method gets, from the command line and the workload's optimizer."""
    return T.Config(lr=args.lr, momentum=args.momentum, layout=layout, seed=args.seed,
                    optimizer=optimizer, weight_decay=args.weight_decay,
                    powersgd_rank=args.powersgd_rank, localsgd_period=args.localsgd_period,
                    localsgd_warmup=args.warmup, diloco_sync_every=args.diloco_sync_every,
                    streaming_fragments=args.streaming_fragments,
                    streaming_delay=args.streaming_delay, pg_timeout=args.pg_timeout,
                    fsdp=args.fsdp, total_steps=args.warmup + args.steps)


def baseline(work, module, cfg: T.Config, steps: int, total: int) -> list[float]:
    """Step 1, the compute-only baseline: ``steps`` timed forward/backward/optimizer steps on
    a copy of ``module`` (never touching the trained model's state), between barriers, so
    that every rank's CPU is as contended as in training."""
    shadow = work.make_model()
    shadow.load_state_dict(module.state_dict())
    shadow_opt = T.inner_optimizer(shadow.parameters(), cfg)
    dist.barrier()
    base_times = []
    for i in range(steps):
        t = time.perf_counter()
        loss = work.loss(shadow, i % total)
        shadow_opt.zero_grad(set_to_none=True)
        loss.backward()
        shadow_opt.step()
        base_times.append(time.perf_counter() - t)
    del shadow, shadow_opt
    dist.barrier()
    return base_times


def step_function(work, built: T.Built, args: argparse.Namespace, cfg: T.Config
                  ) -> Callable[[int], tuple[float, float]]:
    """One training step of the built method on batch ``i``; returns the seconds of forward and
    backward, and of the optimizer step. The learning rate follows ``--lr-schedule`` over
    ``--warmup + --steps`` steps by the batch's index (every method alike: the optimizer the
    method steps, DiLoCo's inner one)."""
    model, opt = built.model, built.optimizer
    lr_at = None if args.lr_schedule == "constant" else \
        T.scheduled(opt, args.lr_schedule, args.warmup + args.steps, cfg.lr)

    def train_step(i: int) -> tuple[float, float]:
        if lr_at is not None:
            lr_at(i)
        t0 = time.perf_counter()
        loss = work.loss(model, i)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP methods communicate here (overlapped with backward)
        t1 = time.perf_counter()
        opt.step()  # ASSGD / post-local SGD / DiLoCo (optimizer hooks) communicate here
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    return train_step


def warm_up(built: T.Built, train_step: Callable[[int], Any], steps: int) -> None:
    """Step 2: enter the method's context, take the untimed warm-up steps, complete their
    traffic, barrier."""
    # Entered around warm-up and timed steps (torchft's DiLoCo hooks the optimizer here).
    built.context.__enter__()
    for i in range(steps):
        train_step(i)
    built.flush()
    dist.barrier()


def read_counters(here: Place, built: T.Built, node_counters: bool) -> Readings:
    """The byte counters (:data:`Readings`); the node's only when ``node_counters``."""
    counters = read_iface_bytes(here.iface) if node_counters else None
    retrans = read_tcp_retransmits() if counters is not None else None
    return counters, retrans, built.comm_stats()


def kill_plan(args: argparse.Namespace, layout: T.Layout,
              budget: float | None) -> dict[str, Any] | None:
    """A lost node: which, and when (after a step of its own, or a time into the window);
    None without ``--kill-node``.

    Raises:
        ValueError: the layout has no such node.
    """
    if args.kill_node is None:
        return None
    if args.kill_node >= layout.nodes:
        raise ValueError(f"--kill-node {args.kill_node}: the layout has nodes 0.."
                         f"{layout.nodes - 1}")
    return {"node": args.kill_node, "at": args.kill_at,
            "step": None if budget is not None else round(args.kill_at * args.steps),
            "time_s": None if budget is None else args.kill_at * budget}


def timed_steps(args: argparse.Namespace, here: Place, built: T.Built,
                train_step: Callable[[int], tuple[float, float]], budget: float | None,
                max_steps: int, kill: dict[str, Any] | None, marker: Path,
                fastest: tuple[Path, float] | None = None, *, origin: float | None = None,
                spare_agent: bool = False) -> Timed:
    """Step 4, the timed window: ``--steps`` steps, or each node's own ``budget`` seconds (at
    most ``max_steps`` steps), or (``fastest``: the flag file and the snapshots' spacing in
    seconds) until the first node has taken ``--steps`` steps; snapshots of the parameters at
    evenly spaced steps (or times); progress lines from rank 0; the node ``kill`` names dies on
    its step or time. Under a lost node a rank whose communication fails stops there
    (``Timed.stop``). A rank that came back (``--join-at``) measures the window from ``origin``
    (the first ranks' opening, a ``perf_counter`` reading) and has no snapshots for the marks
    before it; ``spare_agent``: the node's loss kills its ranks, not its torchrun agent."""
    rank, node = here.rank, here.node
    doomed = kill is not None and node == kill["node"] and origin is None
    # Snapshot marks: steps (every rank takes the same ones), or times (per-node budgets).
    snap_steps = {round(k * args.steps / args.snapshots) for k in range(1, args.snapshots + 1)}
    snap_times = [k * budget / args.snapshots for k in range(1, args.snapshots + 1)] \
        if budget is not None else []
    if fastest is not None:
        flag, spacing = fastest
        snap_times = fastest_marks(spacing, args.snapshots)
    snapshots: list[Snapshot | None] = []
    step_times: list[float] = []
    step_ends: list[float] = []
    fwd_bwd: list[float] = []
    opt_times: list[float] = []
    report_every = max(1, args.steps // 50)
    t_open = time.perf_counter() if origin is None else origin
    keeps_snapshots = here.keeps_snapshots
    # A sharded model's snapshot is gathered whole by every rank of the node (at step marks,
    # which they all take); one of them keeps it.
    takes_snapshots = keeps_snapshots or built.sharded

    def snapshot(step: int) -> None:
        # Parameters only: a copy of 2 MB costs ~1 ms, evaluation happens after the run.
        state = S.full_state(built.module) if built.sharded else \
            {k: v.clone() for k, v in built.module.state_dict().items()}
        if keeps_snapshots:
            snapshots.append((step, time.perf_counter() - t_open, state))

    if takes_snapshots and origin is None:
        snapshot(0)
    elif keeps_snapshots:  # came back: no snapshot for the start and the marks passed
        passed = time.perf_counter() - t_open
        snapshots.extend([None] * (1 + sum(m <= passed for m in snap_times)))

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    s = 0

    def lose_node() -> NoReturn:
        kill_this_node(marker, {"node": node, "rank": rank, "step": s,
                                "time_s": time.perf_counter() - t_open, "time": time.time()},
                       agent=not spare_agent)

    if doomed and kill["time_s"] is not None:
        # Whatever the main thread is doing (a step, a wait): the machine dies on time.
        timer = threading.Timer(max(0.0, kill["time_s"] - (time.perf_counter() - t_open)),
                                lose_node)
        timer.daemon = True
        timer.start()
    elif doomed and kill["step"] == 0:
        lose_node()
    stop: dict[str, Any] | None = None  # a survivor whose communication failed
    try:
        while s < max_steps:
            # A node's ranks agree to stop every STOP_CHECK_EVERY steps (they take the same
            # steps, so they check at the same ones): a vote every step would cost a method
            # that votes a collective per step the others do not pay (2.6 ms at 2x2 here).
            votes = s % STOP_CHECK_EVERY == 0
            if budget is not None:
                if votes and built.node_any(time.perf_counter() - t_open >= budget):
                    break
            elif fastest is not None:
                if (votes or s >= args.steps) and \
                        built.node_any(s >= args.steps or flag.exists()):
                    break
            elif s >= args.steps:
                break
            s += 1
            t = time.perf_counter()
            a, b = train_step(args.warmup + s - 1)
            step_times.append(time.perf_counter() - t)
            step_ends.append(time.time())
            fwd_bwd.append(a)
            opt_times.append(b)
            elapsed = time.perf_counter() - t_open
            if fastest is not None and s >= args.steps:
                fastest[0].touch()   # the first node there ends every node's window
            if takes_snapshots:
                if not snap_times and s in snap_steps:
                    snapshot(s)
                # Time marks: snapshot 0 is the start, snapshot k belongs to snap_times[k - 1].
                while snap_times and len(snapshots) <= len(snap_times) \
                        and elapsed >= snap_times[len(snapshots) - 1]:
                    snapshot(s)
            if rank == 0:
                done = min(s, args.steps) if budget is None else min(
                    args.steps, round(args.steps * elapsed / budget))
                if s % report_every == 0:
                    print(f"QCB_PROGRESS {done} {args.steps}", flush=True)
            if doomed and s == kill["step"]:
                lose_node()
    except Exception as exc:
        if kill is None:
            raise
        # Steps completed: the failed one was not; it is the step the rank stopped at.
        stop = stop_record(exc, "step", len(step_times) + 1)
        s = len(step_times)
    if doomed and kill["time_s"] is not None:
        timer.cancel()  # the node got through its steps before the time of its loss
    if fastest is not None and keeps_snapshots and snapshots[-1][0] != s:
        snapshot(s)   # where the node stopped: the curve's last point
    steps_done = s
    t_loop = time.perf_counter() - t_open
    if rank == 0:
        print(f"QCB_PROGRESS {args.steps} {args.steps}", flush=True)
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, Path(f"{args.out}.prof{rank}.txt"))
    return Timed(steps_done, step_times, fwd_bwd, opt_times, snapshots, t_open, t_loop, stop,
                 step_ends)


def finish(args: argparse.Namespace, work, built: T.Built, here: Place, timed: Timed,
           start: Readings, base_times: list[float], model: tuple[int, list]) -> NoReturn:
    """Steps 5 and 6 of a run without a lost node: close the window (traffic completed,
    barrier, counters read), make the final model, gather every rank's record, close the
    method; after the last collective rank 0 evaluates and writes the JSON
    (:func:`write_result`). Then leave."""
    built.flush()
    dist.barrier()
    counters0, retrans0, stats0 = start
    counters1, retrans1, stats1 = read_counters(here, built, counters0 is not None)
    t_window = time.perf_counter() - timed.t_open

    built.context.__exit__(None, None, None)
    built.finalize()
    # The final model whole, gathered by the node's ranks together (rank 0 evaluates it alone).
    final_state = S.full_state(built.module) if built.sharded else None
    snap_file = Path(f"{args.out}.node{here.node}.snapshots")
    if here.keeps_snapshots:  # every namespace shares the file system
        torch.save(timed.snapshots, snap_file)
    dist.barrier()
    mine = rank_record(here.rank, here.node, here.local_rank, timed.steps, timed.step_times,
                       timed.fwd_bwd, timed.opt_times, base_times, timed.t_loop, t_window,
                       None if counters0 is None else (counters0, counters1),
                       None if retrans0 is None else (retrans0, retrans1),
                       None if stats0 is None else (stats0, stats1))
    pace = built.pace()
    if pace is not None:
        mine.update(pace)
    gathered: list[Any] | None = [None] * here.world if here.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    built.close()
    dist.barrier()
    # The last collective is behind every rank: rank 0 evaluates and writes only now. Inside a
    # collective the other ranks would wait on that evaluation (every snapshot of the curve)
    # under the group's timeout; the transformer's once outlasted 30 s, and a run that had
    # trained to the end failed in its last barrier.
    if here.rank == 0:
        write_result(args, work, built, here, gathered, model, final_state)
    # Leave without tearing down the process group: with PowerSGD's hook a rank sometimes
    # aborts in Gloo's teardown ("terminate called without an active exception", SIGABRT) after
    # everything finished, which would turn a complete run into a failed one. Every rank passed
    # the barrier above and rank 0 wrote the results; the OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_result(args: argparse.Namespace, work, built: T.Built, here: Place,
                 ranks: list[dict], model: tuple[int, list],
                 final_state: dict[str, torch.Tensor] | None = None) -> None:
    """Rank 0 at the end of a run without a lost node: every node's snapshots evaluated into
    the curve, the final model (``final_state`` when the module is sharded) evaluated, one
    JSON with every rank's record."""
    info = work.info
    metric = info.metric
    per_node = []
    for n in range(here.layout.nodes):
        f = Path(f"{args.out}.node{n}.snapshots")
        per_node.append(torch.load(f, weights_only=True))
        f.unlink()
    curve = evaluate_curve(work, per_node)
    evaluator = built.module
    if final_state is not None:
        evaluator = work.make_model()
        evaluator.load_state_dict(final_state)
    final = work.evaluate(evaluator)
    numel, shapes = model
    result = {
        "method": args.method,
        "workload": args.workload,
        "metric": {"name": metric, "goal": info.goal},
        "layout": {"nodes": here.layout.nodes, "procs": here.layout.procs,
                   "world": here.world},
        "model": {**work.model_config, "params": numel, "shapes": shapes},
        "data": work.data_config,
        "config": run_config(args),
        f"final_{metric}": final,
        "curve": curve,
        "ranks": ranks,
        "notes": built.notes,
    }
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(f"QCB_DONE {args.method} final {metric}={final:.4f}", flush=True)


def fastest_marks(spacing: float, snapshots: int, *, doublings: int = 6) -> list[float]:
    """The snapshot times (seconds since the window opened) of a run that ends at the fastest
    node's steps: ``4 x snapshots`` marks every ``spacing`` seconds (four times the fastest
    node's compute alone), then, for a run that communication or a slow machine makes longer,
    blocks of ``snapshots / 2`` marks, each block's spacing twice the last one's (the curve
    thins out instead of stopping, which made a late crossing read as the end of the run).
    Every node computes the same marks, so the k-th snapshots of the nodes belong together."""
    marks = [k * spacing for k in range(1, 4 * snapshots + 1)]
    step, per_block = spacing, max(1, snapshots // 2)
    for _ in range(doublings):
        step *= 2
        marks += [marks[-1] + step * (j + 1) for j in range(per_block)]
    return marks


def snapshot_spacing(base_times: list[float], args: argparse.Namespace) -> float:
    """Seconds between the snapshots of a run until the fastest node's ``--steps``: the fastest
    rank's compute-only step (the median of its baseline, agreed over every rank: a
    collective) times ``--steps``, over ``--snapshots``. A step with communication is longer,
    so a run takes somewhat more snapshots than ``--snapshots``."""
    fastest = torch.tensor([statistics.median(base_times)], dtype=torch.float64)
    dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
    return float(fastest) * args.steps / args.snapshots


def join_job(args: argparse.Namespace) -> tuple[Place, dict[str, float] | None]:
    """This rank's place in the job: one torchrun world, or (``--join-at``) nodes linked through
    the rendezvous. A rank started again by its torchrun (the lost node coming back) first
    waits until ``--join-at`` of the window; its timeline (wall-clock) is returned, else None."""
    if args.join_at is None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
        return find_place(), None
    # The join's steps (announced, offered, joined) in every node's log, with times.
    logging.basicConfig(format="%(asctime)s.%(msecs)03d %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("qcomm").setLevel(logging.INFO)
    timeline = None
    if J.restarted():
        timeline = {"process_start": time.time()}
        opened = J.wait_for_window(args.out, args.pg_timeout)
        time.sleep(max(0.0, opened + args.join_at * args.time_budget - time.time()))
        timeline["window_opened"] = opened
    seat, nodes = J.init_linked(args.pg_timeout)
    if timeline is not None:
        timeline["seat_taken"] = time.time()
    return find_place(seat, nodes), timeline


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several ranks per 2-core machine: oversubscription distorts times
    here, timeline = join_job(args)
    came_back = timeline is not None
    # Per-rank batches for every step a rank may take (a per-node budget may take more).
    per_node = args.time_budget is not None and M.per_node_budget(args.method)
    until_fastest = args.until_fastest and M.per_node_budget(args.method)
    max_steps = (args.max_steps or 100 * args.steps) if per_node else args.steps
    total = args.warmup + max_steps
    work = W.load(args.workload, Path(args.data), rank=here.rank, seed=args.seed,
                  batch=args.batch, total_steps=total, args=args)
    cfg = method_config(args, here.layout, work.info.optimizer)
    torch.manual_seed(args.seed)  # same initial weights on every rank and for every method
    module = work.make_model()
    model = (sum(p.numel() for p in module.parameters()),
             [list(p.shape) for p in module.parameters()])

    # The steps 1 to 6 of the module's docstring (bench/cluster/README.md, "workload.py").
    # A node that came back skips the baseline and the warm-up (the others are training).
    base_times = [] if came_back else baseline(work, module, cfg, args.baseline_steps,
                                               total)  # 1.
    if here.rank == 0:
        # A run before this one into the same --out left its flag files: they would stop this
        # one at its first step (warm_up's barrier orders the removal before any check).
        for stale in (f"{args.out}.fastest", f"{args.out}.killed", f"{args.out}.window"):
            Path(stale).unlink(missing_ok=True)
    if timeline is not None:   # a node that came back announces its join as its method is built
        timeline["build_start"] = time.time()
    built = M.build(args.method, module, cfg)
    train_step = step_function(work, built, args, cfg)
    warm_up(built, train_step, 0 if came_back else args.warmup)  # 2.
    start = read_counters(here, built, here.local_rank == 0 and here.layout.nodes > 1)  # 3.
    budget = args.time_budget if per_node else None
    kill = kill_plan(args, here.layout, budget)
    marker = Path(f"{args.out}.killed")
    fastest = (Path(f"{args.out}.fastest"), snapshot_spacing(base_times, args)) \
        if until_fastest else None
    if args.join_at is not None and here.rank == 0:
        write_json(J.window_file(args.out), {"time": time.time()})  # the window opens now
    origin = J.perf_origin(timeline["window_opened"]) if came_back else None
    timed = timed_steps(args, here, built, train_step, budget, max_steps, kill, marker,
                        fastest, origin=origin, spare_agent=args.join_at is not None)  # 4.
    if timeline is not None:
        stepped = bool(timed.step_ends)
        timeline["first_step_start"] = \
            timed.step_ends[0] - timed.step_times[0] if stepped else None
        timeline["first_step_end"] = timed.step_ends[0] if stepped else None
    if kill is not None:
        end_after_kill(args, work, built, here, timed, start, base_times, kill, marker, model,
                       timeline)
    finish(args, work, built, here, timed, start, base_times, model)  # 5. and 6.


if __name__ == "__main__":
    main()
