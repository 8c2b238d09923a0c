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
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from bench.progress import note, progress

HERE = Path(__file__).resolve().parent
NETNS = HERE / "netns.sh"
WORKLOAD = HERE / "workload.py"
RECOVERY = HERE / "recovery.py"

# The project's targets for its method (measured side by side with ddp and the peers).
TARGET_SPEEDUP = 4.95
TARGET_ACC_POINTS = 1.0
TARGET_BYTES_RATIO = 1 / 7
# The qcomm method the targets are about, per workload.
SUBJECT = {"mnist1d": "assgd-4", "mnist1d-bn": "assgd-4", "charlm": "qcomm-hier-4"}
# Fields of a run summarized per cell as median [min, max] over the repetitions.
SPREAD_FIELDS = ("step_median_s", "samples_per_s", "time_to_target_s", "steps_to_target",
                 "final", "inter_bytes_iface", "comm_fraction", "loop_s")
# Fields where a repetition that never reached the target counts as infinitely slow.
NEVER_FIELDS = ("time_to_target_s", "steps_to_target")


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


def time_to_target(curve: Sequence[dict[str, float]], target: float, metric: str = "test_acc",
                   goal: str = "max", at: str = "time_s") -> float | None:
    """Wall-clock seconds (since the timed window opened) of the first snapshot whose
    ``metric`` reaches ``target`` (``goal`` "max": at least, "min": at most); None when none
    does. ``at="step"``: that snapshot's step instead (:func:`steps_to_target`)."""
    for point in curve:
        v = point[metric]
        if (v >= target) if goal == "max" else (v <= target):
            return point[at]
    return None


EQUAL_STEPS = (0.25, 0.5, 0.75, 1.0)   # fractions of --steps: the quality at equal steps


def quality_at_steps(curve: Sequence[dict[str, float]], steps: int, metric: str,
                     fractions: Sequence[float] = EQUAL_STEPS,
                     by: str = "fastest_step") -> dict[str, float | None]:
    """The quality of the first curve point at or past each fraction of ``steps`` of the
    fastest node (``by="fastest_step"``; a lockstep method's points have one ``step`` for every
    node) or of the nodes' mean (``by="step"``: equal work, the same samples seen however
    they fell between the nodes), keyed by the step (``"150"``); None where the curve stops
    short of it. It compares how well methods train per step, whatever each step costs."""
    out: dict[str, float | None] = {}
    for frac in fractions:
        at = round(frac * steps)
        point = next((p for p in curve if p.get(by, p["step"]) >= at - 1e-9), None)
        out[str(at)] = None if point is None else point[metric]
    return out


def steps_to_target(curve: Sequence[dict[str, float]], target: float,
                    metric: str = "test_acc", goal: str = "max") -> float | None:
    """The step (of the timed window) of the first snapshot whose ``metric`` reaches
    ``target``; None when none does. Unlike the time, it does not depend on the machine's
    load, so it compares how well lockstep methods train per step."""
    return time_to_target(curve, target, metric, goal, at="step")


def _metric(result: dict[str, Any]) -> tuple[str, str]:
    """(metric, goal) of a run's JSON; runs written before there were workloads are MNIST-1D."""
    m = result.get("metric") or {"name": "test_acc", "goal": "max"}
    return m["name"], m["goal"]


def kill_summary(result: dict[str, Any], target: float) -> dict[str, Any]:
    """What the survivors of a lost node did, from a run's JSON written under ``--kill-node``.

    ``behaviour``: ``"stops at step s: ErrorName"`` when a surviving rank's communication failed
    (the earliest stop; ``steps a-b`` when the ranks stopped at different steps, the place in
    parentheses when it was not a training step, e.g. ``finalize``), ``"continues with M
    nodes"`` when the node was lost and every survivor finished (M: qcomm's ``live_nodes``
    where reported, else the surviving nodes), ``"finished"`` when the node was not lost.
    ``time_to_target_s``: the survivors' first snapshot reaching ``target``; for a method that
    stops, only snapshots taken before the loss count (steps up to the kill step, or times up
    to the kill time for per-node budgets). ``final``: the run's final quality (the surviving
    nodes' final parameters averaged when every survivor finished, else the last snapshot);
    ``best``: the best quality of the survivors' snapshots.
    """
    kill, ranks, curve = result["kill"], result["ranks"], result["curve"]
    metric, goal = _metric(result)
    survivors = sum(1 for n in result["nodes"] if not n["killed"])
    stopped = [r for r in ranks if r.get("status") == "stopped"]
    missing = result.get("missing_ranks") or []
    stop = None
    if stopped:
        first = min(stopped, key=lambda r: (r["error"]["step"], r["rank"]))
        at = sorted({r["error"]["step"] for r in stopped})
        where = first["error"]["where"]
        stop = {"step": at[0], "error": first["error"]["type"], "where": where,
                "message": first["error"]["message"], "ranks": [r["rank"] for r in stopped]}
        behaviour = (f"stops at step {at[0]}" if len(at) == 1 else
                     f"stops at steps {at[0]}-{at[-1]}") \
            + ("" if where == "step" else f" ({where})") + f": {stop['error']}"
        outcome = "stops"
    elif missing:
        behaviour, outcome = f"stops: no result from ranks {missing}", "stops"
    elif kill["happened"]:
        live = [r["live_nodes"] for r in ranks if r.get("live_nodes") is not None]
        behaviour = f"continues with {min(live) if live else survivors} nodes"
        outcome = "continues"
    else:
        behaviour, outcome = "finished", "finished"
    counted = curve
    if outcome == "stops" and kill["happened"]:
        if kill.get("step") is not None:
            counted = [p for p in curve if p["step"] <= kill["step"]]
        else:
            counted = [p for p in curve if p["time_s"] <= kill["killed_at_s"]]
    values = [p[metric] for p in curve]
    best = (max(values) if goal == "max" else min(values)) if values else None
    return {
        "kill": {k: kill.get(k) for k in ("node", "at", "step", "time_s", "happened",
                                          "killed_at_step", "killed_at_s")},
        "behaviour": behaviour, "outcome": outcome, "stop": stop,
        "survivor_nodes": survivors, "missing_ranks": missing,
        "time_to_target_s": time_to_target(counted, target, metric, goal),
        "steps_to_target": steps_to_target(counted, target, metric, goal),
        "final": result[f"final_{metric}"], "final_from": result.get("final_from"),
        "best": best, "counted_curve": counted,
    }


def summarize_run(result: dict[str, Any], target: float) -> dict[str, Any]:
    """One run's JSON (workload.py) -> one repetition's row of the table.

    Bytes are per training step and per node (what one node puts on its link): interface
    counters are averaged over nodes; qcomm's stats are summed over a node's ranks, then averaged
    over nodes. ``comm_fraction`` is ``1 - compute-only step / step``, averaged over ranks.
    A run with a lost node (``kill`` in the JSON) has rows of the surviving ranks only, some of
    which may have stopped before their first step; :func:`kill_summary` adds what the
    survivors did, and the bytes are not compared (the formulas assume every node took every
    step, and no barrier closed the window).
    """
    cfg, lay, ranks = result["config"], result["layout"], result["ranks"]
    steps, nodes = cfg["steps"], lay["nodes"]
    # Steps each rank took in the window: --steps, or its node's own count under a per-node
    # time budget (wait-free gossip). Per-step figures divide by each rank's own count.
    for r in ranks:
        r.setdefault("steps", steps)
    timed = [r for r in ranks if r["step_median_s"] is not None and r["steps"] > 0]
    step_med = statistics.median(r["step_median_s"] for r in timed) if timed else None
    loop = max(r["loop_s"] for r in ranks)
    # A node that came back (--join-at) skipped the compute-only baseline.
    based = [r for r in timed if r["baseline_median_s"] is not None]
    comm_frac = statistics.fmean(max(0.0, 1.0 - r["baseline_median_s"] / r["step_median_s"])
                                 for r in based) if based else None
    counted = [r for r in ranks if r["iface_tx_bytes"] is not None and r["steps"] > 0]
    iface = statistics.fmean(r["iface_tx_bytes"] / r["steps"] for r in counted) \
        if counted else None
    pk = [r for r in counted if r.get("iface_tx_packets") is not None]
    packets = statistics.fmean(r["iface_tx_packets"] / r["steps"] for r in pk) \
        if pk and len(pk) == len(counted) else None
    payload = M.tcp_payload(iface, packets) if packets is not None else None
    qstats = [r for r in ranks if r.get("qcomm_bytes") is not None and r["steps"] > 0]
    # Per node: every node, or the nodes with ranks in the JSON when a node was lost.
    per = nodes if result.get("kill") is None else max(1, len({r["node"] for r in ranks}))
    qcomm_inter = (sum(r["qcomm_bytes"]["inter"] / r["steps"] for r in qstats) / per) \
        if qstats else None
    qcomm_intra = (sum(r["qcomm_bytes"]["intra"] / r["steps"] for r in qstats) / per) \
        if qstats else None
    heads = sorted((r for r in ranks if r.get("local_rank", 0) == 0),
                   key=lambda r: r.get("node", 0))
    node_steps = [r["steps"] for r in heads]
    node_rates = [r["steps"] / r["loop_s"] for r in heads]
    node_compute = [r["baseline_median_s"] for r in heads]
    layout = T.Layout(nodes, lay["procs"])
    notes = result.get("notes") or {}
    expected = M.expected_inter_bytes(
        result["method"], result["model"]["shapes"], layout,
        powersgd_rank=cfg.get("powersgd_rank", 4), localsgd_period=cfg.get("localsgd_period", 8),
        window=(cfg.get("warmup", 0), steps),
        diloco_sync_every=notes.get("sync_every", cfg.get("diloco_sync_every", 16)),
        fragment_numel=notes.get("fragment_numel"),
        fragment_delay=notes.get("fragment_sync_delay", 0), sharded=bool(cfg.get("fsdp")))
    metric, goal = _metric(result)
    reference = qcomm_inter if qcomm_inter is not None else expected
    ref_kind = "qcomm" if qcomm_inter is not None else ("formula" if expected is not None else None)
    agree = M.agreement(iface, reference) if iface is not None and reference is not None else None
    agree_payload = (M.agreement(payload, reference)
                     if payload is not None and reference is not None else None)
    row = {
        "method": result["method"],
        "workload": result.get("workload", "mnist1d"),
        "layout": f"{nodes}x{lay['procs']}",
        "status": "ok",
        "params": result["model"]["params"],
        "metric": metric,
        "goal": goal,
        "step_median_s": step_med,
        # Samples of every rank over the slowest rank's loop (the job ends with it).
        "samples_per_s": sum(cfg["batch"] * r["steps"] for r in ranks) / loop,
        "node_steps": node_steps,
        "node_steps_per_s": node_rates,
        "node_compute_step_s": node_compute,
        "time_to_target_s": time_to_target(result["curve"], target, metric, goal),
        "steps_to_target": steps_to_target(result["curve"], target, metric, goal),
        "quality_at_steps": quality_at_steps(result["curve"], steps, metric),
        "quality_at_work": quality_at_steps(result["curve"], steps, metric, by="step"),
        "final": result[f"final_{metric}"],
        "inter_bytes_iface": iface,
        "inter_packets_iface": packets,
        "inter_payload_iface": payload,
        "payload_rel_diff": agree_payload,
        "inter_bytes_qcomm": qcomm_inter,
        "intra_bytes_qcomm": qcomm_intra,
        "inter_bytes_formula": expected,
        "bytes_reference": ref_kind,
        "bytes_rel_diff": agree,
        "comm_fraction": comm_frac,
        "compute_step_s": statistics.fmean(
            r["baseline_median_s"] for r in ranks if r["baseline_median_s"] is not None),
        "fwd_bwd_s": statistics.fmean(r["fwd_bwd_median_s"] for r in timed) if timed else None,
        "opt_step_s": statistics.fmean(r["opt_step_median_s"] for r in timed) if timed else None,
        "loop_s": loop,
        "curve": result["curve"],
        "notes": notes,
    }
    if result.get("kill") is not None:
        row.update(kill_summary(result, target))
        row["bytes_rel_diff"] = row["payload_rel_diff"] = None
    if result.get("rejoin") is not None:
        row.update(rejoin_summary(result, row, target))
    return row


# What a lost node that came back adds (rejoining.join_summary's figures).
REJOIN_FIELDS = ("kill_to_first_step_s", "restart_to_first_step_s", "join_s",
                 "running_rate_vs_before_join_min", "running_rate_vs_before_join_median",
                 "running_rate_vs_before_kill_min", "running_rate_vs_before_kill_median")


def rejoin_summary(result: dict[str, Any], row: dict[str, Any],
                   target: float) -> dict[str, Any]:
    """The row's rejoin figures, and its behaviour saying whether the node came back. Ranks of
    the returning node that stopped (a join that failed) do not make the run one that stops:
    the others went on, and their whole curve counts."""
    rejoin, node = result["rejoin"], result["kill"]["node"]
    out: dict[str, Any] = {"rejoin": {k: rejoin.get(k) for k in REJOIN_FIELDS}}
    stop = row.get("stop")
    node_of = {r["rank"]: r["node"] for r in result["ranks"]}
    if stop is not None and not all(node_of.get(r) == node for r in stop["ranks"]):
        return out   # a running node stopped: the run stops, as kill_summary says
    back = rejoin.get("kill_to_first_step_s")
    metric, goal = _metric(result)
    out.update(outcome="continues", counted_curve=result["curve"],
               time_to_target_s=time_to_target(result["curve"], target, metric, goal),
               steps_to_target=steps_to_target(result["curve"], target, metric, goal),
               behaviour=(f"continues; node {node} did not come back"
                          + ("" if stop is None else f" (its join: {stop['error']})")
                          if back is None else
                          f"continues; node {node} back {back:.1f} s after its loss"))
    return out


def aggregate_rejoin(ok: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per rejoin figure, the median over the repetitions that have it and its [min, max]."""
    out: dict[str, Any] = {}
    for k in REJOIN_FIELDS:
        vals = [r["rejoin"][k] for r in ok if (r.get("rejoin") or {}).get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
        out[f"{k}_spread"] = [min(vals), max(vals)] if vals else None
    return {"rejoin": out}


def rejoin_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per cell, when the lost node took its first step again (after its loss, after
    its restart), how long its join took (the method's build, which announces it, takes the
    state and links, and the first step; for an elastic restart, from the node's torchrun
    entering the rendezvous), and the running nodes' step rate during the join over their rate
    before it and over their rate before the loss (min and median over the running ranks; an
    elastic restart has no rate before the join: its nodes were starting again), medians
    [min-max]."""
    lines = ["| workload | layout | rate | method | loss to first step s | restart to first "
             "step s | the join s | running rate during join / before it (min) | (median) | "
             "/ before the loss (min) | (median) | time to target s |", "|" + "---|" * 12]
    for r in rows:
        rj = r.get("rejoin")
        if r.get("status") != "ok" or not rj:
            continue
        cells = [_median_spread(rj.get(k), rj.get(f"{k}_spread")) for k in REJOIN_FIELDS]
        ttt = fmt_spread(r["time_to_target_s"], (r.get("spread") or {}).get("time_to_target_s"),
                         ".1f", none="never")
        lines.append(f"| {r.get('workload', 'mnist1d')} | {r['layout']} | {r['rate']} | "
                     f"{r['method']} | " + " | ".join(cells) + f" | {ttt} |")
    return "\n".join(lines)


def _median_or_none(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def aggregate(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The repetitions of one cell (summarized runs, any status) -> the cell's row.

    Every field of SPREAD_FIELDS is the median over the ok repetitions, and ``spread[field]``
    holds [min, max]. A repetition that never reached the target counts as infinitely slow: the
    median time (and steps) to target is None ("never") when at least half of them never did. Bytes
    agreement is the worst repetition's. The curve is that of the repetition with the median
    time to target (the median step time when no repetition reached it), for the plots.
    A cell without ok repetitions keeps the first failure's status.
    """
    ok = [r for r in reps if r.get("status") == "ok"]
    if not ok:
        return {**reps[0], "repeats": len(reps), "repeats_ok": 0}
    row = dict(ok[0])
    row.pop("counted_curve", None)  # per repetition below
    spread: dict[str, list[float] | None] = {}
    for key in SPREAD_FIELDS:
        vals = [r.get(key) for r in ok]
        if key in NEVER_FIELDS:
            inf = float("inf")
            med = statistics.median([inf if v is None else v for v in vals])
            row[key] = None if med == inf else med
            got = [v for v in vals if v is not None]
            spread[key] = [min(got), max(got)] if got else None
            continue
        got = [v for v in vals if v is not None]
        row[key] = statistics.median(got) if got else None
        spread[key] = [min(got), max(got)] if got else None
    for key in ("bytes_rel_diff", "payload_rel_diff"):
        got = [r[key] for r in ok if r.get(key) is not None]
        row[key] = max(got) if got else None
    for key in ("quality_at_steps", "quality_at_work"):
        marks = [r[key] for r in ok if r.get(key)]
        if marks:
            got = {k: [m[k] for m in marks if m.get(k) is not None] for k in marks[0]}
            row[key] = {k: statistics.median(v) if v else None for k, v in got.items()}
            row[f"{key}_spread"] = {k: [min(v), max(v)] if v else None for k, v in got.items()}
    for key in ("node_steps", "node_steps_per_s", "node_compute_step_s"):
        lists = [r[key] for r in ok if r.get(key)]
        if lists and all(len(v) == len(lists[0]) for v in lists):
            # (a node that came back has no compute-only baseline: None there)
            row[key] = [_median_or_none([v for v in col if v is not None])
                        for col in zip(*lists, strict=True)]
    for key in ("inter_bytes_qcomm", "intra_bytes_qcomm", "inter_bytes_formula",
                "inter_packets_iface", "inter_payload_iface", "compute_step_s", "fwd_bwd_s",
                "opt_step_s"):
        got = [r[key] for r in ok if r.get(key) is not None]
        row[key] = statistics.median(got) if got else None

    def rank_key(r: dict[str, Any]) -> float:
        t = r.get("time_to_target_s")
        return float("inf") if t is None else t

    def step_key(r: dict[str, Any]) -> float:
        t = r.get("step_median_s")
        return float("inf") if t is None else t

    reached = any(r.get("time_to_target_s") is not None for r in ok)
    order = sorted(ok, key=rank_key if reached else step_key)
    row["curve"] = order[(len(order) - 1) // 2]["curve"]
    row["spread"] = spread
    row["repeats"] = len(reps)
    row["repeats_ok"] = len(ok)
    row["failed_repeats"] = [r["status"] for r in reps if r.get("status") != "ok"]
    # Each repetition's curve (the part that counts, for a method stopped by a lost node), so
    # that verdicts.py can judge other targets and budgets on every repetition.
    row["per_repeat"] = [{**{k: r.get(k) for k in (*SPREAD_FIELDS, "bytes_rel_diff", "status")},
                          "curve": r.get("counted_curve", r.get("curve"))} for r in reps]
    if any(r.get("kill") for r in ok):
        row.update(aggregate_kill(ok))
        for r, out in zip(reps, row["per_repeat"], strict=True):
            out.update({k: r.get(k) for k in (*KILL_FIELDS, "rejoin")})
    if any(r.get("rejoin") for r in ok):
        row.update(aggregate_rejoin(ok))
    return row


# What a run with a lost node adds to its row and to each repetition's figures.
KILL_FIELDS = ("behaviour", "outcome", "stop", "best", "final_from")


def aggregate_kill(ok: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The lost-node fields of a cell: the behaviour (the repetitions' one, or each distinct
    one with how many repetitions showed it, the most frequent first), the median best
    quality with its [min, max]."""
    counts = Counter(r.get("behaviour") or "-" for r in ok)
    behaviour = next(iter(counts)) if len(counts) == 1 else \
        "; ".join(f"{b} ({n}x)" for b, n in counts.most_common())
    outcomes = Counter(r.get("outcome") for r in ok)
    best = [r["best"] for r in ok if r.get("best") is not None]
    return {"behaviour": behaviour, "outcome": outcomes.most_common(1)[0][0],
            "best": statistics.median(best) if best else None,
            "best_spread": [min(best), max(best)] if best else None}


def check_targets(rows: Sequence[dict[str, Any]], subject: str = "assgd-4") -> list[dict[str, Any]]:
    """The targets for the qcomm method ``subject`` in one (workload, layout, rate) group of
    rows: each with ``name``, ``ok`` (True/False, None when it cannot be judged), ``value`` and
    ``need``. Peers are the torch and torchft methods. The quality target (within 1 point of
    ddp's accuracy) is for accuracy; for a loss the difference is reported, unjudged."""
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    a, d = by.get(subject), by.get("ddp")
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, value: Any, need: str) -> None:
        out.append({"name": name, "ok": ok, "value": value, "need": need})

    if a is None or d is None:
        add(f"{subject} vs ddp", None, None, f"needs ok runs of both {subject} and ddp")
        return out
    ta, td = a["time_to_target_s"], d["time_to_target_s"]
    if ta is None or td is None:
        add("time-to-target speedup over ddp", None if td is None else False,
            None, f">= {TARGET_SPEEDUP}x (a method did not reach the target)")
    else:
        add("time-to-target speedup over ddp", td / ta >= TARGET_SPEEDUP, td / ta,
            f">= {TARGET_SPEEDUP}x")
    peers = [r for r in by.values() if M.METHODS[r["method"]].family in ("torch", "torchft")]
    for p in peers:
        if p["method"] == "ddp":
            continue
        tp = p["time_to_target_s"]
        ok = None if ta is None else (tp is None or ta < tp)
        add(f"faster than {p['method']}", ok, None if (ta is None or tp is None) else tp / ta,
            "> 1x")
    if a.get("goal", "max") == "max":
        diff_points = 100.0 * (a["final"] - d["final"])
        add("final accuracy vs ddp (points)", diff_points >= -TARGET_ACC_POINTS, diff_points,
            f">= -{TARGET_ACC_POINTS}")
    else:
        add(f"final {a['metric']} vs ddp (difference)", None, a["final"] - d["final"],
            "reported (no target for a loss)")
    ba, bd = a["inter_bytes_iface"], d["inter_bytes_iface"]
    if ba is not None and bd:
        add("inter-node bytes/step vs ddp", ba / bd <= TARGET_BYTES_RATIO, ba / bd,
            f"<= 1/7 = {TARGET_BYTES_RATIO:.4f}")
    return out


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def fmt(v: float | None, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def fmt_spread(v: float | None, spread: Sequence[float] | None, spec: str, scale: float = 1.0,
               none: str = "-") -> str:
    """``median [min-max]`` (the spread only when it differs from the median)."""
    text = fmt(None if v is None else v * scale, spec, none)
    if spread and v is not None and spread[0] != spread[1]:
        text += f" [{spread[0] * scale:{spec}}-{spread[1] * scale:{spec}}]"
    return text


def fmt_quality(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.2f}%" if metric == "test_acc" else f"{v:.3f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table of cell rows (aggregated repetitions, or single runs). With a lost
    node (rows with ``kill``), time to target and final quality are the survivors', and the
    best quality and the behaviour (stops / continues / finished) follow."""
    head: tuple[str, ...] = (
        "workload", "layout", "rate", "method", "n", "step ms", "samples/s",
        "t->target s [min-max]", "steps->target", "final", "inter B/step (iface)",
        "(qcomm|formula)", "diff", "diff -hdr", "comm %")
    killed = any(r.get("kill") for r in rows)
    if killed:
        head = (*head[:7], "survivors t->target s [min-max]", "survivors steps->target",
                "survivors final", *head[10:],
                "best", "behaviour")
    lines = []
    notes: dict[int, str] = {}  # row -> status, printed after the row (it sizes no column)
    for r in rows:
        if r.get("status") != "ok":
            failed = r["status"].startswith("failed")
            n = f"0/{r.get('repeats', 1)}" if failed else "-"
            notes[len(lines)] = r["status"]
            lines.append((r.get("workload", "mnist1d"), r["layout"], r["rate"], r["method"], n,
                          *([""] * (len(head) - 5))))
            continue
        ref = r["inter_bytes_qcomm"] if r["inter_bytes_qcomm"] is not None else \
            r["inter_bytes_formula"]
        tag = {"qcomm": "q", "formula": "f"}.get(r["bytes_reference"] or "", "")
        spread = r.get("spread") or {}
        n = str(r.get("repeats_ok", 1))
        if r.get("repeats", 1) != r.get("repeats_ok", 1):
            n += f"/{r['repeats']}"
        lines.append((
            r.get("workload", "mnist1d"), r["layout"], r["rate"], r["method"], n,
            fmt_spread(r["step_median_s"], spread.get("step_median_s"), ".1f", 1e3),
            fmt(r["samples_per_s"], ".0f"),
            fmt_spread(r["time_to_target_s"], spread.get("time_to_target_s"), ".1f",
                       none="never"),
            fmt_spread(r.get("steps_to_target"), spread.get("steps_to_target"), ".0f",
                       none="never"),
            fmt_quality(r["final"], r.get("metric", "test_acc")),
            fmt_bytes(r["inter_bytes_iface"]),
            f"{fmt_bytes(ref)} {tag}".strip(), fmt(None if r["bytes_rel_diff"] is None
                                                   else 100 * r["bytes_rel_diff"], ".2f") + "%",
            fmt(None if r.get("payload_rel_diff") is None else 100 * r["payload_rel_diff"],
                ".2f") + "%",
            fmt(None if r["comm_fraction"] is None else 100 * r["comm_fraction"], ".0f"),
        ))
        if killed:
            lines[-1] = (*lines[-1], fmt_quality(r.get("best"), r.get("metric", "test_acc")),
                         r.get("behaviour") or "-")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    for i, line in enumerate(lines):
        if i in notes:
            out.append("  ".join(str(x).ljust(w) for x, w in zip(line[:5], widths, strict=False))
                       + "  " + notes[i])
        else:
            out.append("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))
    return "\n".join(out)


def kill_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: what each method did when the node was lost (rows of one sweep with
    ``--kill-node``): behaviour, the survivors' time to target and final quality, the best
    quality their snapshots reached."""
    lines = ["| workload | layout | rate | method | behaviour | survivors' time to target s | "
             "survivors' final | best |", "|" + "---|" * 8]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r.get('workload', 'mnist1d')} | {r['layout']} | {r['rate']} | "
                         f"{r['method']} | {r['status']} | - | - | - |")
            continue
        metric = r.get("metric", "test_acc")
        ttt = fmt_spread(r["time_to_target_s"], (r.get("spread") or {}).get("time_to_target_s"),
                         ".1f", none="never")
        lines.append(f"| {r.get('workload', 'mnist1d')} | {r['layout']} | {r['rate']} | "
                     f"{r['method']} | {r.get('behaviour') or '-'} | {ttt} | "
                     f"{fmt_quality(r['final'], metric)} | {fmt_quality(r.get('best'), metric)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# running


def settings(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """What workload.py gets for ``workload``: the command line's values, the workload's
    defaults where the command line left them out."""
    info = W.WORKLOADS[workload]
    out: dict[str, Any] = {}
    for key in ("width", "depth", "batch", "lr", "momentum", "weight_decay", "steps", "target"):
        v = getattr(args, key)
        out[key] = getattr(info, key) if v is None else v
    return out


def netns(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(NETNS), *args], check=check, **kw)


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
    script = RECOVERY if recovery_run(method, args) else WORKLOAD
    return [str(script), "--workload", workload, "--method", method, "--data", str(data), *budget,
            "--out", str(out_json), *F.command_line(values, F.PASSED_ON)]


def recovery_run(method: str, args: argparse.Namespace) -> bool:
    """Whether this run of ``method`` is a peer's own recovery (recovery.py): a lost node comes
    back (``--join-at``) and the method is DDP or local SGD (elastic restart) or torchft's
    (streaming) DiLoCo (heal)."""
    return args.join_at is not None and M.recovers_by_itself(method)


def launch_command(cluster: str, layout: T.Layout, cmd_args: list[str], timeout: int,
                   log: Path, slow: tuple[int, float] = (0, 1.0), lost: int | None = None,
                   equal_cpu: bool = False, comes_back: bool = False,
                   rejoin: tuple[str, Path] | None = None) -> list[str]:
    """netns.sh's command that launches one run on the cluster (see :func:`run_one`);
    ``comes_back``: the lost node comes back (``--join-at``): nodes linked through a rendezvous,
    the lost node's torchrun restarting its ranks; ``rejoin`` (a peer's own recovery,
    recovery.py): ``("elastic", file)``, one elastic torchrun job, or ``("heal", file)``, a
    torchrun per node; either way the lost node's torchrun is started again at the time the
    file (recovery.py writes it) names."""
    back = ["--linked", "--restart-node", str(lost)] if comes_back and lost is not None else []
    if rejoin is not None and lost is not None:
        back = ["--elastic" if rejoin[0] == "elastic" else "--linked", "--restart-node",
                str(lost), "--rejoin-file", str(rejoin[1])]
    return ["bash", str(NETNS), "launch", "--id", cluster, "--nodes", str(layout.nodes),
            "--procs", str(layout.procs), "--timeout", str(timeout),
            "--slow-nodes", str(slow[0]), "--slowdown", str(slow[1]),
            *(["--lost-node", str(lost)] if lost is not None and not comes_back else []),
            *back, *(["--equal-cpu"] if equal_cpu else []),
            "--logdir", str(log.parent / log.stem), "--", *cmd_args]


def run_one(cluster: str, layout: T.Layout, cmd_args: list[str], timeout: int, out_json: Path,
            log: Path, bar: Any, slow: tuple[int, float] = (0, 1.0),
            lost: int | None = None, equal_cpu: bool = False,
            comes_back: bool = False) -> tuple[int, str]:
    """Launch one run on the cluster (``slow``: the last ``slow[0]`` nodes capped to
    ``1 / slow[1]`` of the others' CPU; ``lost``: the node the run kills, whose end is no
    failure); stream node 0's progress into ``bar``. A command of recovery.py runs as the
    peer's own recovery (its files of an earlier run into the same ``out_json`` removed)."""
    out_json.unlink(missing_ok=True)
    rejoin = None
    if Path(cmd_args[0]) == RECOVERY:
        method = cmd_args[cmd_args.index("--method") + 1]
        stale = J.recovery_files(str(out_json))
        rejoin = ("heal" if M.heals(method) else "elastic", stale["rejoin"])
        shutil.rmtree(stale["dir"], ignore_errors=True)
        for key in ("window", "rejoin", "killed"):
            stale[key].unlink(missing_ok=True)
    cmd = launch_command(cluster, layout, cmd_args, timeout, log, slow, lost, equal_cpu,
                         comes_back, rejoin)
    # torchrun of this interpreter's environment (netns.sh looks for TORCHRUN first).
    torchrun = Path(sys.executable).with_name("torchrun")
    extra = {"TORCHRUN": str(torchrun)} if torchrun.exists() else {}
    env = dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log, "w") as logf, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                logf.write(line)
                if line.startswith("QCB_PROGRESS"):
                    done = int(line.split()[1])
                    bar.update(done - bar.n)
                else:
                    tail = [*tail[-30:], line]
            rc = proc.wait()
        except BaseException:
            # Interrupted (SIGTERM, Ctrl-C): stop the launch, which stops its nodes, before
            # Popen's exit waits for it; the caller then removes the cluster.
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return rc, "".join(tail)


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


QUALITY_LABEL = {"test_acc": "test accuracy (%)", "val_loss": "validation loss (nats/char)"}


def plot(rows: Sequence[dict[str, Any]], outdir: Path,
         targets: dict[str, float]) -> list[Path]:
    """Per (workload, layout, rate): quality against wall-clock time for every method (the
    median repetition's curve; horizontal bars: min-max time to target over repetitions), and
    inter-node bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in rows if r.get("status") == "ok"]
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in ok:
        groups.setdefault((r.get("workload", "mnist1d"), r["layout"], r["rate"]), []).append(r)
    for (workload, layout, rate), rs in groups.items():
        metric = rs[0].get("metric", "test_acc")
        scale = 100.0 if metric == "test_acc" else 1.0
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        target = targets[workload]
        for i, r in enumerate(rs):
            t = [p["time_s"] for p in r["curve"]]
            q = [scale * p[metric] for p in r["curve"]]
            family = M.METHODS[r["method"]].family
            style = {"qcomm": "-", "torchft": "-.", "torch": "--"}[family]
            n = r.get("repeats_ok", 1)
            (line,) = ax1.plot(t, q, style, label=f"{r['method']} (n={n})", color=f"C{i % 10}")
            span = (r.get("spread") or {}).get("time_to_target_s")
            if span:
                ax1.plot(span, [scale * target] * 2, color=line.get_color(), lw=4, alpha=0.4)
        ax1.axhline(scale * target, color="grey", lw=0.8, ls=":")
        ax1.set_xlabel("wall-clock time in the timed window (s)")
        ax1.set_ylabel(QUALITY_LABEL.get(metric, metric))
        if metric == "val_loss":
            # losses start far above the interesting part: show the target and 1 nat above
            lo = min([scale * target] + [scale * p[metric] for r in rs for p in r["curve"]])
            ax1.set_ylim(lo - 0.05, lo + 1.0)
        ax1.set_title(f"{workload}, {layout} (nodes x procs), {rate} between nodes")
        ax1.legend(fontsize=8)
        names = [r["method"] for r in rs]
        iface = [r["inter_bytes_iface"] or 0 for r in rs]
        colors = {"torch": "C0", "torchft": "C2", "qcomm": "C1"}
        ax2.bar(names, iface, color=[colors[M.METHODS[n].family] for n in names])
        ax2.set_yscale("log")
        ax2.set_ylabel("inter-node bytes per step per node (interface counters)")
        ax2.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        p = outdir / f"quality_time_{workload}_{layout}_{rate}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


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
    F.add_flags(p, ("powersgd_rank", "localsgd_period", "diloco_sync_every",
                    "streaming_fragments", "streaming_delay"))
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
    F.add_flags(p, ("max_steps", "kill_node", "kill_at", "join_at", "pg_timeout", "fsdp"),
                unset=("pg_timeout",))
    p.add_argument("--timeout", type=int, default=900, help="The seconds allowed per run.")
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
    check_kill(p, args)
    if args.fsdp and (args.kill_node is not None or args.time_budget is not None):
        p.error("--fsdp runs are healthy and take --steps steps: it cannot be combined with "
                "--kill-node or --time-budget")
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


@dataclass
class Sweep:
    """What one invocation sweeps over, where its files go, and each workload's data file and
    target (filled in by :func:`make_data`)."""

    workloads: list[str]
    layouts: list[T.Layout]
    rates: list[str]
    names: list[str]
    outdir: Path
    data: dict[str, Path] = field(default_factory=dict)
    data_info: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)

    @property
    def combos(self) -> list[tuple[T.Layout, str]]:
        """The (layout, rate) pairs, one cluster each."""
        return [(lay, rate) for lay in self.layouts for rate in self.rates]


# One cell of the table: (workload, layout tag, rate, method).
Cell = tuple[str, str, str, str]


def plan(args: argparse.Namespace) -> Sweep:
    """The command line's lists, checked (ValueError names a bad one), and the output
    directory, made."""
    workloads = W.parse_workloads(args.workload)
    layouts = [parse_layout(s) for s in args.layouts.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        rate_bits_per_s(r)
    names = M.parse_methods(args.methods)
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
                  *(["--delay-ms", f"{args.delay_ms:g}"] if args.delay_ms is not None else []))
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
    cmd = workload_command(w, name, args, sweep.data[w], out_json, tag, rep)
    with progress(settings(w, args)["steps"], f"  {name}", position=1, leave=False) as bar:
        rc, tail = run_one(cluster, layout, cmd, args.timeout, out_json,
                           sweep.outdir / "runs" / f"{stem}.log", bar,
                           (args.slow_nodes, args.slowdown), args.kill_node,
                           args.equal_cpu, args.join_at is not None)
    if rc != 0 or not out_json.exists():
        note(f"{stem}: FAILED (exit {rc}); log {sweep.outdir}/runs/{stem}.log\n{tail}")
        return {**base, "status": f"failed (exit {rc})"}
    row = summarize_run(json.loads(out_json.read_text()), sweep.targets[w])
    return {**row, "rate": rate}


# ---------------------------------------------------------------------------------------------
# the report


def _median_spread(median: float | None, lo_hi: list[float] | None) -> str:
    """``0.4 [0.35-0.45]``; no spread when the repetitions agree, ``-`` for no figure."""
    if median is None:
        return "-"
    return f"{median:.4g}" + (f" [{lo_hi[0]:.4g}-{lo_hi[1]:.4g}]"
                              if lo_hi and lo_hi[0] != lo_hi[1] else "")


def equal_steps_table(rows: Sequence[dict[str, Any]], key: str = "quality_at_steps") -> str:
    """Per cell, the quality (median over repetitions [min-max]) at equal steps of the fastest
    node (``key="quality_at_work"``: at equal mean steps of the nodes)."""
    keyed = [r for r in rows if r.get(key)]
    if not keyed:
        return ""
    marks = list(keyed[0][key])
    lines = ["| workload | layout | rate | method | " + " | ".join(
        f"at step {m}" for m in marks) + " |", "|---" * (4 + len(marks)) + "|"]
    for r in keyed:
        q, spread = r[key], r.get(f"{key}_spread") or {}
        cells = [_median_spread(q.get(m), spread.get(m)) for m in marks]
        lines.append(f"| {r.get('workload', 'mnist1d')} | {r['layout']} | {r['rate']} | "
                     f"{r['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_tables(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table of every cell, the quality at equal steps; with a lost node, what each method
    did."""
    print()
    print(table(rows))
    steps = equal_steps_table(rows)
    if steps:
        print("\nquality at equal steps of the fastest node (median of the repetitions "
              "[min-max]):\n")
        print(steps)
    work = equal_steps_table(rows, "quality_at_work")
    if work:
        print("\nquality at equal work, the nodes' mean steps (median of the repetitions "
              "[min-max]):\n")
        print(work)
    if args.kill_node is not None:
        print(f"\nnode {args.kill_node} lost at {args.kill_at:g} of each run:\n")
        print(kill_table(rows))
    if args.join_at is not None:
        print(f"\nnode {args.kill_node} back at {args.join_at:g} of each run:\n")
        print(rejoin_table(rows))


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


def problems(rows: Sequence[dict[str, Any]],
             args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(cells whose two byte counts disagree, cells with a failed run)."""
    # Judged where the second count is the method's own (qcomm's stats); formulas are payload
    # only, and PowerSGD's many small messages carry more framing than 5%
    # (bench/results/2026-11-30-cluster-sweeps.md).
    # Not under a lost node: no barrier closes the window, and the survivors stop apart.
    bad_bytes = [r for r in rows if r.get("status") == "ok" and r["bytes_reference"] == "qcomm"
                 and not r.get("kill")
                 and (r["bytes_rel_diff"] is None or r["bytes_rel_diff"] > args.agree)]
    failed = [r for r in rows if r.get("status", "").startswith("failed")
              or r.get("failed_repeats")]
    return bad_bytes, failed


def write_summary(sweep: Sweep, args: argparse.Namespace, env: dict[str, Any],
                  rows: Sequence[dict[str, Any]], checks: dict[str, list[dict]],
                  bad_bytes: Sequence[dict], failed: Sequence[dict]) -> Path:
    """Everything the sweep found, as ``summary.json`` in the output directory."""
    # The lost-node and timeout options only when given (a healthy sweep's summary as before).
    given = {k: v for k, v in vars(args).items()
             if not (k in ("kill_node", "kill_at", "join_at", "pg_timeout") and v is None)}
    summary = {"environment": env, "args": given, "data": sweep.data_info, "targets_quality":
               sweep.targets, "rows": rows, "targets": checks,
               "bytes_disagree": [r["method"] for r in bad_bytes],
               "failed": [f"{r.get('workload')} {r['layout']} {r['rate']} {r['method']}"
                          for r in failed]}
    path = sweep.outdir / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("compare.py: needs root (netns.sh creates network namespaces, a bridge and tc "
              "qdiscs); run it as root or with sudo", file=sys.stderr)
        return 1
    sweep = plan(args)
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
