"""The end of a cluster run in which a node is lost: no collective over all ranks, files
instead. Every surviving rank writes its record (and each node its snapshots); rank 0 waits
for them, with a deadline, evaluates the surviving nodes' snapshots and final parameters and
writes the run's JSON.

Imported by workload.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import rejoining as J
from bench.cluster import training as T
from bench.cluster.link_counters import Readings, read_iface_bytes, read_tcp_retransmits
from bench.cluster.node_loss import cut_connections, stop_record
from bench.cluster.rank_place import Place
from bench.cluster.run_record import run_result, write_json
from bench.cluster.snapshot_eval import average_states, evaluate_curve
from bench.cluster.timed_window import Timed, timed_record


def end_after_kill(args: argparse.Namespace, work, built: T.Built, here: Place, timed: Timed,
                   start: Readings, base_times: list[float], kill: dict[str, Any] | None,
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
    the ranks that came back, their ``timeline``, and rank 0 waits for every rank. ``kill``
    None: nodes linked through the rendezvous (``--links``), none lost, which share no
    collective over all ranks either: the same files, a healthy run's JSON."""
    counters0, _, stats0 = start
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
    rec = timed_record(here, timed, base_times, t_window, start,
                       (counters1, retrans1, stats1))
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


# Left to rank 0 after its wait for the records, before the launch's own kill: to evaluate the
# survivors' snapshots and write the JSON (seconds; the evaluations take a few on CPU).
ASSEMBLE_S = 30.0


def records_deadline(pg_timeout: float, environ: dict[str, str] | None = None) -> float:
    """When rank 0 stops waiting for the other ranks' records (``time.monotonic()``): the
    longest any communication may block (``pg_timeout``, at least 300 s) plus two minutes,
    but :data:`ASSEMBLE_S` before the launch kills the node (``QCB_KILLED_AT``, the Unix time
    its ``timeout`` fires, which netns.sh sets), so that a rank that never writes one leaves
    a JSON that names it rather than none."""
    deadline = time.monotonic() + max(pg_timeout, 300.0) + 120.0
    killed_at = (os.environ if environ is None else environ).get("QCB_KILLED_AT")
    if killed_at:
        deadline = min(deadline, time.monotonic() + float(killed_at) - time.time() - ASSEMBLE_S)
    return deadline


def assemble_after_kill(args: argparse.Namespace, work, built: T.Built,
                        kill: dict[str, Any] | None,
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
            not comes_back and kill is not None and r // procs == kill["node"]
            and marker.exists())

    deadline = records_deadline(args.pg_timeout)
    while not all(accounted(r) for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not all(accounted(r) for r in range(world)):
        print(f"rank 0: no record from ranks {[r for r in range(world) if not accounted(r)]} "
              f"by the deadline: the JSON names them in missing_ranks", file=sys.stderr)
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
    result = {
        **run_result(args, work, layout, model, final=final, curve=curve,
                     ranks=sorted(ranks, key=lambda r: r["rank"]), notes=built.notes),
        "final_from": final_from,
        "missing_ranks": missing,
    }
    if kill is not None:
        result["kill"] = {**kill, "happened": killed is not None,
                          "killed_at_step": None if killed is None else killed["step"],
                          "killed_at_s": None if killed is None else killed["time_s"]}
        result["nodes"] = [{"node": n, "killed": n in lost} for n in range(layout.nodes)]
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
    lost_said = "no node lost" if kill is None else \
        f"node {kill['node']} {'killed' if killed else 'not killed'}"
    print(f"QCB_DONE {args.method} final {metric}={shown} ({lost_said}, {final_from})",
          flush=True)


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/lost_node_end.py is a library of the cluster benchmark "
        "(the end of a run with a lost node), imported by workload.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
