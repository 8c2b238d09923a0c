"""The Lightning cell's tables from a sweep's run files: a qcomm method in the plain loop
(workload.py) against the same method under ``QcommStrategy`` and against ``strategy="ddp"``
(lightning_worker.py), per method the median [min-max] over repetitions of the seconds to
several targets, the quality at equal steps, the bytes a node puts on its link per step and the
time of a step; then Lightning-qcomm over plain-loop-qcomm, per target (each repetition's pair:
the sweep interleaves them).

    python bench/cluster/lightning_table.py OUT/runs --plain adamw-slow-link \\
        --targets 2.2,2.0,1.9 [--json OUT/lightning_table.json]

Reads the runs that finished (a sweep stopped early still gives its tables).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.run_summary import quality_at_steps, reached

RUN = re.compile(r"(?P<cell>.+)_(?P<method>[^_]+)_r(?P<rep>\d+)\.json")


def load_runs(runs: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """Every finished run's JSON, by method and repetition."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(runs.glob("*.json")):
        m = RUN.fullmatch(path.name)
        if m:
            out.setdefault(m["method"], {})[int(m["rep"])] = json.loads(path.read_text())
    return out


def span(values: list[float | None], fmt: str = "{:.1f}") -> str:
    """``median [min-max]`` of the values, ``never`` where a run never got there."""
    if not values:
        return "-"
    if any(v is None for v in values):
        got = sum(v is not None for v in values)
        return f"never ({got} of {len(values)} did)" if got else "never"
    med = statistics.median(values)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def figures(result: dict[str, Any], targets: list[float]) -> dict[str, Any]:
    """One run's figures: seconds to each target, quality at quarter steps, bytes and times."""
    metric = result["metric"]["name"]
    goal = result["metric"]["goal"]
    ranks, nodes = result["ranks"], result["layout"]["nodes"]
    steps = result["config"]["steps"]
    heads = [r for r in ranks if r["iface_tx_bytes"] is not None]
    qcomm = [r for r in ranks if r.get("qcomm_bytes")]
    return {
        "to_target_s": {t: reached(result["curve"], t, metric, goal)["time_to_target_s"]
                        for t in targets},
        "at_steps": quality_at_steps(result["curve"], steps, metric),
        "final": result[f"final_{metric}"],
        "iface_bytes_per_step": statistics.fmean(r["iface_tx_bytes"] / steps for r in heads)
        if heads else None,
        "qcomm_bytes_per_step": sum(r["qcomm_bytes"]["inter"] for r in qcomm) / steps / nodes
        if qcomm else None,
        "step_mean_ms": 1e3 * statistics.median(r["step_mean_s"] for r in ranks),
        "step_median_ms": 1e3 * statistics.median(r["step_median_s"] for r in ranks),
        "compute_ms": 1e3 * statistics.median(r["baseline_median_s"] for r in ranks),
        # Medians of the step's parts: forward and backward (DDP's all-reduce overlaps it),
        # the optimizer step (the gossip), and the rest of the loop between two steps (in
        # workload.py's loop, nothing; under Lightning, its hooks and bookkeeping).
        "fwd_bwd_ms": 1e3 * statistics.median(r["fwd_bwd_median_s"] for r in ranks),
        "opt_ms": 1e3 * statistics.median(r["opt_step_median_s"] for r in ranks),
        "rest_ms": 1e3 * statistics.median(
            r["step_median_s"] - r["fwd_bwd_median_s"] - r["opt_step_median_s"] for r in ranks),
        "loop_s": max(r["loop_s"] for r in ranks),
    }


def tables(runs: dict[str, dict[int, dict[str, Any]]], plain: str, targets: list[float]
           ) -> tuple[str, dict[str, Any]]:
    """The markdown tables and their figures."""
    figs = {m: {rep: figures(res, targets) for rep, res in reps.items()}
            for m, reps in runs.items()}
    order = [plain, *sorted(m for m in figs if m != plain)]
    lines = ["| method | n | " + " | ".join(f"s to {t:g}" for t in targets)
             + " | final | inter B/step (iface) | (qcomm) | step ms (mean) | compute ms | loop s |",
             "|---|---|" + "---|" * (len(targets) + 6)]
    for m in order:
        f = list(figs[m].values())
        cells = [str(len(f)), *(span([x["to_target_s"][t] for x in f]) for t in targets),
                 span([x["final"] for x in f], "{:.3f}"),
                 span([x["iface_bytes_per_step"] for x in f], "{:,.0f}"),
                 span([x["qcomm_bytes_per_step"] for x in f], "{:,.0f}")
                 if f[0]["qcomm_bytes_per_step"] is not None else "-",
                 span([x["step_mean_ms"] for x in f]), span([x["compute_ms"] for x in f]),
                 span([x["loop_s"] for x in f])]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    fracs = list(next(iter(figs[plain].values()))["at_steps"])
    lines += ["", "| method | " + " | ".join(f"at step {k}" for k in fracs) + " |",
              "|---|" + "---|" * len(fracs)]
    for m in order:
        f = list(figs[m].values())
        lines.append(f"| {m} | " + " | ".join(
            span([x["at_steps"][k] for x in f], "{:.3f}") for k in fracs) + " |")
    parts = ("compute_ms", "fwd_bwd_ms", "opt_ms", "rest_ms", "step_median_ms")
    lines += ["", "| method | compute-only step | forward + backward | optimizer step | rest of "
              "the loop | step (median) |", "|---|" + "---|" * len(parts)]
    for m in order:
        f = list(figs[m].values())
        lines.append(f"| {m} | " + " | ".join(span([x[k] for x in f]) for k in parts) + " |")
    ratios = {}
    lines += ["", "| Lightning / plain loop | " + " | ".join(f"to {t:g}" for t in targets)
              + " | step (mean) |", "|---|" + "---|" * (len(targets) + 1)]
    for m in order[1:]:
        reps = sorted(set(figs[m]) & set(figs[plain]))
        per = {t: [_ratio(figs[m][r]["to_target_s"][t], figs[plain][r]["to_target_s"][t])
                   for r in reps] for t in targets}
        per["step"] = [figs[m][r]["step_mean_ms"] / figs[plain][r]["step_mean_ms"] for r in reps]
        ratios[m] = per
        lines.append(f"| {m} | " + " | ".join(span(per[k], "{:.2f}") for k in [*targets, "step"])
                     + " |")
    return "\n".join(lines), {"figures": figs, "ratios_by_repetition": ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, help="the sweep's runs directory (OUT/runs)")
    p.add_argument("--plain", required=True, help="the plain loop's method (adamw-slow-link)")
    p.add_argument("--targets", required=True, help="comma-separated qualities, e.g. 2.2,2.0,1.9")
    p.add_argument("--json", type=Path, default=None, help="where to write the figures")
    args = p.parse_args(argv)
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        p.error(f"--targets must be comma-separated numbers, got {args.targets!r}")
    runs = load_runs(args.runs)
    if args.plain not in runs:
        p.error(f"--plain: no finished run of {args.plain!r} in {args.runs} "
                f"(found: {sorted(runs) or 'none'})")
    text, data = tables(runs, args.plain, targets)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=1, default=str))


if __name__ == "__main__":
    main()
