"""One run of a sweep summarized: a run's JSON (workload.py, recovery.py) -> one repetition's
row of compare.py's table.

The row holds the step times, the time (and steps) to the target, the quality at equal steps,
the inter-node bytes per step from the interface counters, qcomm's stats and the algorithm's
formula with their agreement, and, under a lost node, what the survivors did
(:func:`kill_summary`) and, for a node that came back, what its return cost
(:func:`rejoin_summary`).

Pure Python; imported by compare.py (and verdicts.py, for :func:`time_to_target`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M
from bench.cluster import training as T


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


def reached(curve: Sequence[dict[str, float]], target: float, metric: str,
            goal: str) -> dict[str, float | None]:
    """The row's ``time_to_target_s`` and ``steps_to_target`` on ``curve``."""
    return {"time_to_target_s": time_to_target(curve, target, metric, goal),
            "steps_to_target": steps_to_target(curve, target, metric, goal)}


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
        **reached(counted, target, metric, goal),
        "final": result[f"final_{metric}"], "final_from": result.get("final_from"),
        "best": best, "counted_curve": counted,
    }


def capped_nodes(result: dict[str, Any]) -> list[int]:
    """The nodes of a run under a per-node time budget (seconds) that stopped at ``--max-steps``
    instead: their budget did not decide where they ended, and a machine fast enough to reach
    the cap would end a run that the budget was to keep going (e.g. before a lost node is back).
    Empty for a run without a budget in seconds, or a method whose nodes take ``--steps``."""
    cfg = result["config"]
    if cfg.get("time_budget") is None or not M.per_node_budget(result["method"]):
        return []
    cap = cfg.get("max_steps") or 100 * cfg["steps"]
    return sorted({r["node"] for r in result["ranks"]
                   if r.get("local_rank", 0) == 0 and r.get("steps", 0) >= cap})


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
        "capped_nodes": capped_nodes(result),
        "node_steps_per_s": node_rates,
        "node_compute_step_s": node_compute,
        **reached(result["curve"], target, metric, goal),
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
               **reached(result["curve"], target, metric, goal),
               behaviour=(f"continues; node {node} did not come back"
                          + ("" if stop is None else f" (its join: {stop['error']})")
                          if back is None else
                          f"continues; node {node} back {back:.1f} s after its loss"))
    return out


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/run_summary.py is a library of the cluster benchmark "
        "(one run's JSON summarized as a row of the table), imported by compare.py "
        "and verdicts.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
