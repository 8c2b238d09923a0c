"""The peers' recoveries from a lost node that comes back (``compare.py --join-at``): torchrun's
elastic restart from the last checkpoint for DDP and local SGD, torchft's heal for (streaming)
DiLoCo.

**Elastic restart** (``ddp``, ``localsgd``): every node runs ``torchrun --nnodes MIN:MAX
--rdzv-backend c10d --max-restarts R`` (``netns.sh launch --elastic``), the job checkpoints
every ``--ckpt-every-s`` seconds, and a worker started (or started again) loads the newest
checkpoint. **Heal** (``torchft-diloco``, ``torchft-streaming-diloco``): every node runs its own
torchrun (``netns.sh launch --linked``: the node is one replica group), the lighthouse on node 0
forms quorums of at least N-1 groups, and a node started again fetches the model and the
optimizers' state from a live group at its first quorum.

One process is one life of one rank; node 0's rank 0 of the last life assembles workload.py's
JSON for compare.py. How the restarts and the heal go, what each life records and when the
window opens: bench/cluster/README.md, "recovery.py".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    # torchrun runs this file by path: the repository root first on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import rejoining as J
from bench.cluster import torchft_methods as TF
from bench.cluster import training as T
from bench.cluster import worker_flags as F
from bench.cluster import workload as WL
from bench.cluster import workloads as W
from bench.cluster.node_loss import kill_this_node, stop_record
from bench.cluster.run_record import rank_record, run_config, run_result, write_json
from bench.cluster.snapshot_eval import average_states, evaluate_curve

# Steps between the ranks' votes on the window's end: every rank must stop at the same step.
STOP_CHECK_EVERY = 10
# Seconds between rewrites of a life's record while it trains. A worker its agent stops gets
# SIGTERM and dies with it: a Python handler would run only once the main thread is back in
# Python, and a survivor blocked in a collective with the lost node (Gloo waits up to the
# group's timeout there) would then hold its agent's restart until the SIGKILL 30 s later, a
# delay torch's own users do not have. The last quarter second of steps goes unrecorded.
RECORD_EVERY_S = 0.25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    F.add_run_files(p)
    F.add_flags(p, F.TRAINING)
    p.add_argument("--time-budget", type=float, required=True,
                   help="Seconds of the timed window, wall-clock from its opening in the first "
                        "life: every life trains until it closes.")
    F.add_flags(p, ("max_steps", *F.RUN_END))
    p.add_argument("--ckpt-every-s", type=float, default=1.0,
                   help="Seconds of training between checkpoints: rank 0 writes the model and "
                        "the optimizer's state after the first step this long after the last "
                        "(a restarted worker starts from the newest). Time, not steps: DDP's "
                        "step here is 14x local SGD's, and a small model's checkpoint costs "
                        "milliseconds.")
    args = p.parse_args(argv)
    if not M.recovers_by_itself(args.method):
        p.error(f"--method must be one of {', '.join((*M.ELASTIC_RESTART, *M.HEALS))} (with "
                f"settings), got {args.method!r}")
    if not args.ckpt_every_s > 0:
        p.error(f"--ckpt-every-s must be seconds > 0, got {args.ckpt_every_s:g}")
    if args.time_budget <= 0:
        p.error(f"--time-budget must be seconds > 0, got {args.time_budget:g}")
    if args.kill_node is None or args.kill_at is None or args.join_at is None:
        p.error("--kill-node, --kill-at and --join-at are all needed: this script runs the "
                "recovery of a lost node that comes back")
    if not 0 < args.kill_at < args.join_at < 1:
        p.error(f"--kill-at and --join-at must satisfy 0 < kill-at < join-at < 1, got "
                f"{args.kill_at:g} and {args.join_at:g}")
    if args.fsdp:
        p.error("--fsdp: the recoveries here run whole models per rank")
    args.snapshots = F.default_snapshots(args.snapshots, args.workload)
    return args


class Life:
    """What one process (one life of one rank) records, rewritten to its file as it goes."""

    def __init__(self, path: Path, node: int, local_rank: int, started: float) -> None:
        self.path = path
        self.rec: dict[str, Any] = {
            "node": node, "local_rank": local_rank, "process_start": started,
            "step_ends": [], "step_times": [], "fwd_bwd": [], "opt_times": [],
            "baseline": [], "status": "running"}
        self._written = 0.0

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._written >= RECORD_EVERY_S:
            write_json(self.path, self.rec)
            self._written = now


def _load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)


def _save_atomically(obj: Any, path: Path) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _agree_to_stop(closes: float) -> bool:
    flag = torch.tensor([float(time.time() >= closes)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _place(heal: bool, procs: int, node: int) -> tuple[int, T.Layout]:
    """This rank's rank in the job and the layout: from the job's world (one elastic job), or
    from the node and ``QCB_NODES`` (a node per torchrun, for torchft's heal)."""
    if heal:
        return node * procs + dist.get_rank(), T.Layout(int(os.environ["QCB_NODES"]), procs)
    return dist.get_rank(), T.Layout(dist.get_world_size() // procs, procs)


def _build(args: argparse.Namespace, module, cfg: T.Config, heal: bool, node: int,
           where: dict[str, Path], first_life: bool) -> tuple[T.Built, Callable[[], bool] | None]:
    """The method, and for a group that comes back to a heal, whether it has healed yet (its
    steps before its first quorum are overwritten by the state it fetches there: it takes
    part from the first step after it)."""
    if not heal:
        return M.build(args.method, module, cfg), None
    base, settings = M.resolve(args.method)
    cfg = replace(cfg, **settings)
    ready = where["dir"] / "ready" if first_life else None   # every group in the first quorum
    groups = TF.healing_replicas(cfg, node, where["lighthouse"], ready)
    built = TF.build_diloco(base, module, cfg, groups, quorum_now=first_life)
    return built, None if first_life else (lambda: groups.manager.current_step() > 0)


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    started = time.time()
    args = parse_args(argv)
    torch.set_num_threads(1)
    heal = M.heals(args.method)
    where = J.recovery_files(args.out)
    node = int(os.environ["QCB_NODE"])
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    for d in ("snapshots", "lives"):
        where[d].mkdir(parents=True, exist_ok=True)
    life = Life(where["lives"] / f"n{node}.l{local_rank}.p{os.getpid()}.json", node, local_rank,
                started)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, layout = _place(heal, procs, node)
    life.rec.update(rank=rank, world=layout.world, seat_taken=time.time())
    life.write(force=True)
    max_steps = args.max_steps or 100 * args.steps
    work = W.load(args.workload, Path(args.data), rank=rank, seed=args.seed, batch=args.batch,
                  total_steps=args.warmup + max_steps, args=args)
    cfg = WL.method_config(args, layout, work.info.optimizer)
    torch.manual_seed(args.seed)
    module = work.make_model()
    first_life = not where["window"].exists()
    if first_life:
        life.rec["baseline"] = WL.baseline(work, module, cfg, args.baseline_steps,
                                           args.warmup + max_steps)
    # torchft heals from a live group; the elastic restart starts from the newest checkpoint.
    ckpt = None if heal else _load_checkpoint(where["ckpt"])
    start = 0 if ckpt is None else int(ckpt["step"])
    if ckpt is not None:
        module.load_state_dict(ckpt["model"])
    built, healed = _build(args, module, cfg, heal, node, where, first_life)
    if ckpt is not None:
        built.optimizer.load_state_dict(ckpt["optimizer"])
    train_step = WL.step_function(work, built, args, cfg)
    if first_life:
        WL.warm_up(built, train_step, args.warmup)
        if rank == 0:
            opened = time.time()
            write_json(where["window"], {"time": opened})
            write_json(where["rejoin"], {"time": opened + args.join_at * args.time_budget})
        # Waited for by the other nodes' torchruns in a heal, read by every life.
        J.wait_for_window(args.out, args.pg_timeout)
        dist.barrier()
    else:
        built.context.__enter__()
    opened = J.wait_for_window(args.out, args.pg_timeout)
    life.rec["window_opened"] = opened
    life.rec["resumed_at_step"] = start
    _train(args, where, life, built, train_step, (rank, node, local_rank), opened, start,
           first_life, checkpoints=not heal, healed_groups=heal, healed=healed)
    built.flush()
    if not heal:
        built.finalize()   # local SGD: the replicas averaged (DDP's are equal already)
    life.rec["status"] = "finished"
    life.write(force=True)
    if local_rank == 0:
        # A heal's final model is the nodes' average, made by assemble().
        _save_atomically(built.module.state_dict(), where["dir"] / f"final.n{node}.pt")
    if not heal:
        dist.barrier()
    if rank == 0:
        # The other nodes' finals (a heal's nodes end on their own), then the JSON; node 0
        # keeps the lighthouse up meanwhile.
        _wait_for([where["dir"] / f"final.n{n}.pt" for n in range(layout.nodes)],
                  args.pg_timeout + 30)
        assemble(args, work, built.notes, layout,
                 (sum(p.numel() for p in module.parameters()),
                  [list(p.shape) for p in module.parameters()]))
    sys.stdout.flush()
    os._exit(0)


def _train(args: argparse.Namespace, where: dict[str, Path], life: Life, built: T.Built,
           train_step, place: tuple[int, int, int], opened: float, s: int,
           first_life: bool, *, checkpoints: bool, healed_groups: bool = False,
           healed: Callable[[], bool] | None = None) -> None:
    """The timed window's steps of this life (``place``: rank, node, local rank), from step
    ``s`` (the checkpoint's) until the window closes (the default group's ranks agree on the
    step: the job's, or the node's in a heal: ``healed_groups``); rank 0 checkpoints when
    ``checkpoints``; node ``--kill-node``'s first life dies at ``--kill-at``. ``healed``: whether
    a group that came back has healed (its first step after records ``contributes_from``)."""
    rank, node, local_rank = place
    budget = args.time_budget
    marks = [k * budget / args.snapshots for k in range(args.snapshots + 1)]
    # The marks this life lives through: mark 0 (the start) in the first, else those ahead.
    elapsed = time.time() - opened
    mark = 0 if first_life else next((k for k, m in enumerate(marks) if m >= elapsed),
                                     len(marks))
    doomed = node == args.kill_node and not where["killed"].exists()
    if doomed and local_rank == 0:
        def lose() -> NoReturn:
            kill_this_node(where["killed"], {"node": node, "rank": rank, "step": s,
                                                "time_s": time.time() - opened,
                                                "time": time.time()})
        timer = threading.Timer(max(0.0, opened + args.kill_at * budget - time.time()), lose)
        timer.daemon = True
        timer.start()
    report = max(1, args.steps // 50)
    saved = time.monotonic()
    try:
        while True:
            elapsed = time.time() - opened
            while local_rank == 0 and mark < len(marks) and elapsed >= marks[mark]:
                _save_atomically((s, elapsed, {k: v.clone() for k, v in
                                               built.module.state_dict().items()}),
                                 where["snapshots"] / f"m{mark:03d}.n{node}.pt")
                mark += 1
            if s % STOP_CHECK_EVERY == 0 and _agree_to_stop(opened + budget):
                break
            t = time.perf_counter()
            a, b = train_step(args.warmup + s)
            life.rec["step_times"].append(time.perf_counter() - t)
            life.rec["step_ends"].append(time.time())
            if healed is not None and "contributes_from" not in life.rec and healed():
                life.rec["contributes_from"] = life.rec["step_ends"][-1]
            life.rec["fwd_bwd"].append(a)
            life.rec["opt_times"].append(b)
            s += 1
            if checkpoints and rank == 0 and time.monotonic() - saved >= args.ckpt_every_s:
                _save_atomically({"step": s, "model": built.module.state_dict(),
                                  "optimizer": built.optimizer.state_dict()}, where["ckpt"])
                saved = time.monotonic()
            elapsed = time.time() - opened
            if rank == 0 and s % report == 0:
                print(f"QCB_PROGRESS {min(args.steps, round(args.steps * elapsed / budget))} "
                      f"{args.steps}", flush=True)
            life.write()
    except Exception as exc:
        life.rec["error"] = stop_record(exc, "step", s)
        if not (healed_groups and time.time() >= opened + budget):
            # A peer is gone: this life ends; the agent starts the next from the checkpoint.
            life.rec["status"] = "failed"
            life.write(force=True)
            os._exit(1)
        # A heal's nodes end on their own: a step that began before the window closed waits
        # in its sync for nodes that have stopped, until torchft's timeout; the node stops.
    life.rec["steps_done"] = s
    if rank == 0:
        print(f"QCB_PROGRESS {args.steps} {args.steps}", flush=True)


def merge_lives(lives: list[dict[str, Any]], procs: int, opened: float) -> list[dict[str, Any]]:
    """Every (node, local rank)'s lives -> one record per rank in workload.py's form (its rank
    numbered ``node * procs + local_rank``): the steps of all its lives (steps taken again after
    a restart count again: they are work done), its step ends in order, its first life's
    baseline; ``lives``: how many processes it took."""
    by: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in lives:
        by.setdefault((r["node"], r["local_rank"]), []).append(r)
    out = []
    for (node, local), rs in sorted(by.items()):
        rs.sort(key=lambda r: r["process_start"])
        times = [t for r in rs for t in r["step_times"]]
        ends = sorted(t for r in rs for t in r["step_ends"])
        rec = rank_record(node * procs + local, node, local, len(times), times,
                             [t for r in rs for t in r["fwd_bwd"]],
                             [t for r in rs for t in r["opt_times"]],
                             next((r["baseline"] for r in rs if r["baseline"]), []),
                             (ends[-1] - opened) if ends else 0.0,
                             (ends[-1] - opened) if ends else 0.0, None, None, None)
        rec.update(status="finished", step_ends=ends, lives=len(rs),
                   resumed_at=[r.get("resumed_at_step") for r in rs])
        out.append(rec)
    return out


def joiner_timeline(lives: list[dict[str, Any]], node: int, back: float) -> dict[str, Any]:
    """The lost node's return for rejoining.join_summary: its torchrun started again at
    ``back`` (an elastic agent enters the rendezvous, which is what stops the running nodes:
    the join's window opens there), its worker's seat, its first step that takes part (after
    its heal, for torchft)."""
    after = sorted((r for r in lives if r["node"] == node and r["process_start"] >= back),
                   key=lambda r: r["process_start"])
    # A healed group takes part from its first step after its heal (contributes_from).
    firsts = [r.get("contributes_from", r["step_ends"][0]) for r in after if r["step_ends"]]
    seats = [r["seat_taken"] for r in after if r.get("seat_taken")]
    return {"process_start": back, "build_start": back,
            "seat_taken": min(seats) if seats else None,
            "first_step_end": min(firsts) if firsts else None}


def assemble(args: argparse.Namespace, work, notes: dict[str, Any], layout: T.Layout,
             model: tuple[int, list]) -> None:
    """The last life's rank 0: every life's record, the nodes' snapshots evaluated into the
    curve, the final model evaluated, the lost node's return; workload.py's JSON at ``--out``."""
    where = J.recovery_files(args.out)
    heal = M.heals(args.method)
    lives = [json.loads(f.read_text()) for f in sorted(where["lives"].glob("*.json"))]
    opened = J.wait_for_window(args.out, 0)
    nodes = 1 + max(r["node"] for r in lives)
    procs = layout.procs
    ranks = merge_lives(lives, procs, opened)
    per_node = []
    for n in range(nodes):
        snaps = [where["snapshots"] / f"m{k:03d}.n{n}.pt" for k in range(args.snapshots + 1)]
        per_node.append([torch.load(f, weights_only=True) if f.exists() else None
                         for f in snaps])
    curve = evaluate_curve(work, per_node)
    finals = [torch.load(f, weights_only=True) for f in
              sorted(where["dir"].glob("final.n*.pt"))]
    evaluator = work.make_model()
    evaluator.load_state_dict(average_states(finals))
    metric = work.info.metric
    final = work.evaluate(evaluator)
    killed = json.loads(where["killed"].read_text()) if where["killed"].exists() else None
    back = json.loads(where["rejoin"].read_text())["time"]
    kill = {"node": args.kill_node, "at": args.kill_at, "step": None,
            "time_s": args.kill_at * args.time_budget, "happened": killed is not None,
            "killed_at_step": None if killed is None else killed["step"],
            "killed_at_s": None if killed is None else killed["time_s"]}
    for r in ranks:
        if r["node"] == args.kill_node:
            r["timeline"] = joiner_timeline(lives, args.kill_node, back)
    restarts = sorted({round(r["process_start"] - opened, 2) for r in lives
                       if r["process_start"] > opened})
    result = {
        **run_result(args, work, T.Layout(nodes, procs), model, final=final, curve=curve,
                     ranks=ranks,
                     config={**run_config(args), "recovery": "heal" if heal else "elastic"},
                     notes={**notes, "recovery": "torchft heal from a live replica group"
                            if heal else "torchrun elastic restart from the last checkpoint",
                            "ckpt_every_s": None if heal else args.ckpt_every_s,
                            "lives_started_s": restarts}),
        "kill": kill, "nodes": [{"node": n, "killed": False} for n in range(nodes)],
        "final_from": "final parameters", "missing_ranks": [],
        "rejoin": {"at": args.join_at, **(J.join_summary(
            ranks, None if killed is None else killed["time"], args.kill_node) or {})},
    }
    write_json(Path(args.out), result)
    shown = f"{final:.4f}"
    print(f"QCB_DONE {args.method} final {metric}={shown} (node {args.kill_node} "
          f"{'killed' if killed else 'not killed'}, {result['config']['recovery']}; lives at "
          f"{statistics.median(restarts) if restarts else '-'} s median)", flush=True)


if __name__ == "__main__":
    main()
