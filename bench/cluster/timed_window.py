"""Step 4 of a cluster run, the timed window: the steps (``--steps``, a per-node time budget,
or until the fastest node's ``--steps``), the snapshots of the parameters at evenly spaced
steps or times, the progress lines, the lost node's death on its step or time, the profile of
the timed steps, and the rank's record of its window (:func:`timed_record`).

Imported by workload.py and lost_node_end.py.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import sharding as S
from bench.cluster import training as T
from bench.cluster.link_counters import Readings
from bench.cluster.node_loss import kill_this_node, stop_record
from bench.cluster.rank_place import Place
from bench.cluster.run_record import rank_record
from bench.cluster.snapshot_eval import Snapshot

# Steps between the votes of a node's ranks on stopping a per-node run (timed_steps).
STOP_CHECK_EVERY = 4


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


def timed_record(here: Place, timed: Timed, base_times: list[float], t_window: float,
                 start: Readings, end: Readings) -> dict[str, Any]:
    """:func:`rank_record` of a rank's timed window, with the counters read when it opened
    (``start``) and when it closed (``end``); the method's counters only where both readings
    have them."""
    counters0, retrans0, stats0 = start
    counters1, retrans1, stats1 = end
    return rank_record(here.rank, here.node, here.local_rank, timed.steps, timed.step_times,
                       timed.fwd_bwd, timed.opt_times, base_times, timed.t_loop, t_window,
                       None if counters0 is None else (counters0, counters1),
                       None if retrans0 is None else (retrans0, retrans1),
                       None if stats0 is None or stats1 is None else (stats0, stats1))


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


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/timed_window.py is a library of the cluster benchmark "
        "(the timed window and its snapshots), imported by workload.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
