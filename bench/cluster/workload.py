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
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
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
from bench.cluster.link_counters import Readings, read_counters
from bench.cluster.lost_node_end import end_after_kill
from bench.cluster.node_loss import cut_connections, kill_plan, node_processes, stop_record
from bench.cluster.rank_place import Place, find_place
from bench.cluster.run_record import rank_record, run_config, run_result, write_json
from bench.cluster.snapshot_eval import evaluate_curve
from bench.cluster.timed_window import (
    Timed,
    fastest_marks,
    snapshot_spacing,
    timed_record,
    timed_steps,
)

# The names the tests import from here, wherever they now live: the timed window, the lost
# node, the record and the evaluation are modules of their own beside this one.
__all__ = ["Place", "Timed", "cut_connections", "evaluate_curve", "fastest_marks", "finish",
           "main", "node_processes", "parse_args", "rank_record", "run_config", "stop_record",
           "timed_steps"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    # the flags compare.py, recovery.py and ddp_reference.py take too: declared once, in
    # worker_flags.py
    F.add_run_files(p)
    F.add_flags(p, F.TRAINING)
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
    F.add_flags(p, (*F.RUN_END, "links"))
    args = p.parse_args(argv)
    if args.method not in M.METHODS:
        p.error(f"argument --method: unknown method {args.method!r}{M.near_miss(args.method)}")
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
    args.snapshots = F.default_snapshots(args.snapshots, args.workload)
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
    ``--warmup + --steps`` steps (every method alike: the optimizer the method steps, DiLoCo's
    inner one) by the job's progress: a wait-free qcomm optimizer's ``job_progress()`` (the
    guide's recipe: a node slower than the others decays with the job, not by its own steps),
    the batch's index for the others (lockstep: every node is at the same step, and the
    progress's collective over the node's ranks would cost a step for nothing)."""
    model, opt = built.model, built.optimizer
    lr_at = None if args.lr_schedule == "constant" else \
        T.scheduled(opt, args.lr_schedule, args.warmup + args.steps, cfg.lr)
    progress = getattr(opt, "job_progress", None) if built.node_any is not None else None

    def train_step(i: int) -> tuple[float, float]:
        if lr_at is not None:
            lr_at(i if progress is None else max(i, progress()))
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


def finish(args: argparse.Namespace, work, built: T.Built, here: Place, timed: Timed,
           start: Readings, base_times: list[float], model: tuple[int, list]) -> NoReturn:
    """Steps 5 and 6 of a run without a lost node: close the window (traffic completed,
    barrier, counters read), make the final model, gather every rank's record, close the
    method; after the last collective rank 0 evaluates and writes the JSON
    (:func:`write_result`). Then leave."""
    built.flush()
    dist.barrier()
    end = read_counters(here, built, start[0] is not None)
    t_window = time.perf_counter() - timed.t_open

    built.context.__exit__(None, None, None)
    built.finalize()
    # The final model whole, gathered by the node's ranks together (rank 0 evaluates it alone).
    final_state = S.full_state(built.module) if built.sharded else None
    snap_file = Path(f"{args.out}.node{here.node}.snapshots")
    if here.keeps_snapshots:  # every namespace shares the file system
        torch.save(timed.snapshots, snap_file)
    dist.barrier()
    mine = timed_record(here, timed, base_times, t_window, start, end)
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
    write_json(Path(args.out), run_result(args, work, here.layout, model, final=final,
                                          curve=curve, ranks=ranks, notes=built.notes))
    print(f"QCB_DONE {args.method} final {work.info.metric}={final:.4f}", flush=True)


def join_job(args: argparse.Namespace) -> tuple[Place, dict[str, float] | None]:
    """This rank's place in the job: one torchrun world, or (``--join-at``) nodes linked through
    the rendezvous. A rank started again by its torchrun (the lost node coming back) first
    waits until ``--join-at`` of the window; its timeline (wall-clock) is returned, else None.
    ``--links gloo`` or ``sockets``: linked through the rendezvous too, no node lost."""
    if args.join_at is None and args.links == "world":
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
    if args.links != "world" and args.join_at is None:
        J.open_window_together(args.pg_timeout)   # the world's barrier, across linked nodes
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
    if kill is not None or args.links != "world":   # linked nodes share no collective
        end_after_kill(args, work, built, here, timed, start, base_times, kill, marker, model,
                       timeline)
    finish(args, work, built, here, timed, start, base_times, model)  # 5. and 6.


if __name__ == "__main__":
    main()
