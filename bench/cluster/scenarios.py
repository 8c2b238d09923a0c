"""One table from several sweeps of compare.py: each method in each scenario, side by side.

A scenario is one compare.py sweep (its ``summary.json``) under a name, e.g. ``healthy`` and
``slow`` (the same sweep with ``--slow-nodes 1 --slowdown 2``). For every (workload, layout,
rate, method) the table gives, per scenario, the median time to target with its [min-max]
spread over the repetitions, the final quality, and the step rate of the nodes that were not
slowed (the median over repetitions of each node's steps per second of its training loop); with
two scenarios it also gives the ratio of those rates (slowed scenario over the first one).

    python bench/cluster/scenarios.py healthy=out/a/summary.json slow=out/b/summary.json \\
        --fast-nodes-of slow:1

``--fast-nodes-of NAME:K`` says that in scenario NAME the last K nodes were slowed (their rates
are left out of the fast nodes' rate). Markdown on stdout; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _fmt_time(row: dict[str, Any]) -> str:
    t = row.get("time_to_target_s")
    spread = (row.get("spread") or {}).get("time_to_target_s")
    if t is None:
        reached = [r.get("time_to_target_s") for r in row.get("per_repeat", [])]
        got = sum(v is not None for v in reached)
        return f"never ({got}/{len(reached)} reached)" if reached else "never"
    s = f"{t:.1f}"
    if spread:
        s += f" [{spread[0]:.1f}-{spread[1]:.1f}]"
    return s


def _fmt_final(row: dict[str, Any]) -> str:
    v = row.get("final")
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if row.get("metric", "test_acc") == "test_acc" else f"{v:.3f}"


def fast_rate(row: dict[str, Any], slowed: int) -> float | None:
    """Mean steps per second of the nodes that were not slowed (the last ``slowed`` were)."""
    rates = row.get("node_steps_per_s")
    if not rates:
        return None
    keep = rates[: len(rates) - slowed] if slowed else rates
    return statistics.fmean(keep) if keep else None


def combine(named: list[tuple[str, dict[str, Any]]], slowed: dict[str, int]) -> list[dict]:
    """Rows keyed by (workload, layout, rate, method), one column group per scenario."""
    cells: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for name, summary in named:
        for row in summary["rows"]:
            key = (row.get("workload", "mnist1d"), row["layout"], row["rate"], row["method"])
            entry = cells.setdefault(key, {"workload": key[0], "layout": key[1],
                                           "rate": key[2], "method": key[3]})
            entry[name] = {
                "status": row.get("status", "ok"),
                "time": _fmt_time(row) if row.get("status", "ok") == "ok" else row["status"],
                "time_to_target_s": row.get("time_to_target_s"),
                "final": _fmt_final(row),
                "fast_steps_per_s": fast_rate(row, slowed.get(name, 0)),
                "node_steps": row.get("node_steps"),
            }
    return list(cells.values())


def table(rows: list[dict], names: list[str]) -> str:
    head = ["workload", "layout", "rate", "method"]
    for n in names:
        head += [f"{n}: time to target s", f"{n}: final", f"{n}: fast nodes steps/s"]
    if len(names) >= 2:
        head.append(f"steps/s {names[1]} / {names[0]}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cols = [r["workload"], r["layout"], r["rate"], r["method"]]
        for n in names:
            c = r.get(n)
            if c is None:
                cols += ["-", "-", "-"]
                continue
            rate = c["fast_steps_per_s"]
            cols += [c["time"], c["final"], "-" if rate is None else f"{rate:.0f}"]
        if len(names) >= 2:
            a, b = (r.get(names[0]) or {}), (r.get(names[1]) or {})
            ra, rb = a.get("fast_steps_per_s"), b.get("fast_steps_per_s")
            cols.append(f"{rb / ra:.2f}" if ra and rb else "-")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("sweeps", nargs="+", help="NAME=PATH of a compare.py summary.json, in order.")
    p.add_argument("--fast-nodes-of", action="append", default=[],
                   help="NAME:K: in scenario NAME the last K nodes were slowed.")
    p.add_argument("--json", default="", help="Also write the combined rows here.")
    args = p.parse_args(argv)
    named = []
    for spec in args.sweeps:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"give NAME=PATH, got {spec!r}")
        named.append((name, json.loads(Path(path).read_text())))
    slowed = {}
    for spec in args.fast_nodes_of:
        name, _, k = spec.partition(":")
        slowed[name] = int(k)
    rows = combine(named, slowed)
    print(table(rows, [n for n, _ in named]))
    for name, summary in named:
        env = summary.get("environment", {})
        print(f"\n{name}: {env.get('cpu', '?')}, {env.get('cpus', '?')} CPUs, load at start "
              f"{env.get('loadavg_at_start')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
