"""The repetitions of one cell of a sweep (workload, layout, rate, method) -> the cell's row:
each figure's median over the repetitions with its [min, max], and each repetition's own
figures and curve kept beside them (for verdicts.py).

Pure Python; imported by compare.py.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.run_summary import REJOIN_FIELDS

# Fields of a run summarized per cell as median [min, max] over the repetitions.
SPREAD_FIELDS = ("step_median_s", "samples_per_s", "time_to_target_s", "steps_to_target",
                 "final", "inter_bytes_iface", "comm_fraction", "loop_s")


# Fields where a repetition that never reached the target counts as infinitely slow.
NEVER_FIELDS = ("time_to_target_s", "steps_to_target")


def _spread(values: Sequence[float]) -> list[float] | None:
    """``[min, max]`` of ``values``; None for none."""
    return [min(values), max(values)] if values else None


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
            spread[key] = _spread(got)
            continue
        got = [v for v in vals if v is not None]
        row[key] = _median_or_none(got)
        spread[key] = _spread(got)
    for key in ("bytes_rel_diff", "payload_rel_diff"):
        got = [r[key] for r in ok if r.get(key) is not None]
        row[key] = max(got) if got else None
    for key in ("quality_at_steps", "quality_at_work"):
        marks = [r[key] for r in ok if r.get(key)]
        if marks:
            got = {k: [m[k] for m in marks if m.get(k) is not None] for k in marks[0]}
            row[key] = {k: _median_or_none(v) for k, v in got.items()}
            row[f"{key}_spread"] = {k: _spread(v) for k, v in got.items()}
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
        row[key] = _median_or_none(got)

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
            "best": _median_or_none(best),
            "best_spread": _spread(best)}


def aggregate_rejoin(ok: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per rejoin figure, the median over the repetitions that have it and its [min, max]."""
    out: dict[str, Any] = {}
    for k in REJOIN_FIELDS:
        vals = [r["rejoin"][k] for r in ok if (r.get("rejoin") or {}).get(k) is not None]
        out[k] = _median_or_none(vals)
        out[f"{k}_spread"] = _spread(vals)
    return {"rejoin": out}


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/repetitions.py is a library of the cluster benchmark "
        "(a cell's repetitions aggregated into its row), imported by compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
