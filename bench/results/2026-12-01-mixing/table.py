"""The tables of this folder's README from compare.py's summary.json files.

Per cell (layout, rate) and method: steps to the target (median [min-max] over the
repetitions), final accuracy (median [min-max]), inter-node bytes per step and node (interface
counters, median [min-max]), the median bytes as a fraction of the reference method's in the
same cell, and the repetitions that ran.

    python bench/results/2026-12-01-mixing/table.py screen1.json screen2.json \
        --ref torchft-diloco-h32-o7-m5
    python bench/results/2026-12-01-mixing/table.py --by-seed seed0.json seed1.json seed2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def spread(v: float | None, mm: list[float] | None, fmt: str, scale: float = 1.0,
           never: str = "never") -> str:
    if v is None:
        return never
    text = f"{v * scale:{fmt}}"
    if mm and mm[0] != mm[1]:
        text += f" [{mm[0] * scale:{fmt}}-{mm[1] * scale:{fmt}}]"
    return text


def rows_of(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        rows += json.loads(p.read_text())["rows"]
    return rows


def table(rows: list[dict], ref: str) -> str:
    refs = {(r["layout"], r["rate"]): r.get("inter_bytes_iface") for r in rows
            if r["method"] == ref and r.get("status") == "ok"}
    out = ["| layout | rate | method | steps to 65% | final accuracy | bytes/step/node | "
           f"bytes vs {ref} | runs |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cell = (r["layout"], r["rate"])
        if r.get("status") != "ok" or not r.get("repeats_ok"):
            out.append(f"| {cell[0]} | {cell[1]} | {r['method']} | - | - | - | - | "
                       f"0/{r.get('repeats', 1)} ({r.get('status')}) |")
            continue
        sp = r.get("spread") or {}
        b, rb = r.get("inter_bytes_iface"), refs.get(cell)
        ratio = f"{b / rb:.3f}" if b and rb else "-"
        out.append(
            f"| {cell[0]} | {cell[1]} | {r['method']} | "
            f"{spread(r.get('steps_to_target'), sp.get('steps_to_target'), '.0f')} | "
            f"{spread(r['final'], sp.get('final'), '.2f', 100)}% | "
            f"{spread(b, sp.get('inter_bytes_iface'), '.2f', 1e-3)} kB | {ratio} | "
            f"{r['repeats_ok']}/{r['repeats']} |")
    return "\n".join(out)


def by_seed(paths: list[Path], ref: str, only: list[str] | None = None) -> str:
    """One row per (layout, rate, method) over several sweeps that differ in ``--seed``: each
    seed's steps to the target and final accuracy (its median over repetitions, which are
    identical here: a seed's run is deterministic), then their median [min-max] over seeds."""
    cells: dict[tuple[str, str, str], dict[int, dict]] = {}
    refs: dict[tuple[str, str], list[float]] = {}
    for p in paths:
        summary = json.loads(p.read_text())
        seed = summary["args"]["seed"]
        for r in summary["rows"]:
            if r.get("status") != "ok" or not r.get("repeats_ok") or (
                    only and r["method"] not in only):
                continue
            cells.setdefault((r["layout"], r["rate"], r["method"]), {})[seed] = r
            if r["method"] == ref:
                refs.setdefault((r["layout"], r["rate"]), []).append(r["inter_bytes_iface"])
    out = ["| layout | rate | method | seeds | steps to 65% per seed | median [min-max] | "
           "final accuracy per seed | median [min-max] | bytes/step/node | "
           f"bytes vs {ref} |", "|---|---|---|---|---|---|---|---|---|---|"]
    inf = float("inf")
    order = sorted(cells, key=lambda k: (k[0], k[1], only.index(k[2]))) if only else list(cells)
    for layout, rate, method in order:
        per = cells[(layout, rate, method)]
        seeds = sorted(per)
        steps = [per[s].get("steps_to_target") for s in seeds]
        finals = [per[s]["final"] for s in seeds]
        med_steps = statistics.median(inf if v is None else v for v in steps)
        got = [v for v in steps if v is not None]
        b = statistics.median(per[s]["inter_bytes_iface"] for s in seeds)
        rb = refs.get((layout, rate))
        out.append(
            f"| {layout} | {rate} | {method} | {','.join(map(str, seeds))} | "
            + " / ".join("never" if v is None else f"{v:.0f}" for v in steps) + " | "
            + spread(None if med_steps == inf else med_steps,
                     [min(got), max(got)] if got else None, ".0f") + " | "
            + " / ".join(f"{100 * v:.2f}" for v in finals) + " | "
            + spread(statistics.median(finals), [min(finals), max(finals)], ".2f", 100)
            + f"% | {b / 1e3:.2f} kB | "
            + (f"{b / statistics.median(rb):.3f}" if rb else "-") + " |")
    return "\n".join(out)


def pairs(paths: list[Path], against: list[str], only: list[str] | None = None) -> str:
    """Per seed, each method's steps to the target and final accuracy minus those of each
    method in ``against`` (same seed, same cell): the paired comparison."""
    per: dict[tuple[str, str, str], dict[int, dict]] = {}
    for p in paths:
        summary = json.loads(p.read_text())
        for r in summary["rows"]:
            if r.get("status") == "ok" and r.get("repeats_ok"):
                per.setdefault((r["layout"], r["rate"], r["method"]), {})[
                    summary["args"]["seed"]] = r
    out = ["| layout | method | against | steps to 65%, difference per seed | "
           "final accuracy, points, difference per seed |", "|---|---|---|---|---|"]
    for layout, rate, method in per:
        if method in against or (only and method not in only):
            continue
        for ref in against:
            mine, theirs = per[(layout, rate, method)], per.get((layout, rate, ref), {})
            seeds = sorted(set(mine) & set(theirs))
            if not seeds:
                continue

            def diff(a: float | None, b: float | None) -> str:
                return "n/a" if a is None or b is None else f"{a - b:+.0f}"
            steps = " / ".join(diff(mine[s].get("steps_to_target"),
                                    theirs[s].get("steps_to_target")) for s in seeds)
            final = " / ".join(f"{100 * (mine[s]['final'] - theirs[s]['final']):+.2f}"
                               for s in seeds)
            out.append(f"| {layout} | {method} | {ref} | {steps} (seeds "
                       f"{','.join(map(str, seeds))}) | {final} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summaries", nargs="+", type=Path, help="compare.py summary.json files")
    p.add_argument("--ref", default="torchft-diloco-h32-o7-m5",
                   help="the method whose bytes per step the others are divided by")
    p.add_argument("--by-seed", action="store_true",
                   help="the summaries are sweeps of different --seed: one row per method")
    p.add_argument("--only", default=None,
                   help="with --by-seed: these methods only (comma-separated), in this order")
    p.add_argument("--pairs", default=None,
                   help="with --by-seed: per seed, the differences to these methods "
                        "(comma-separated) instead")
    args = p.parse_args()
    only = args.only.split(",") if args.only else None
    if args.by_seed and args.pairs:
        print(pairs(args.summaries, args.pairs.split(","), only))
    else:
        print(by_seed(args.summaries, args.ref, only) if args.by_seed
              else table(rows_of(args.summaries), args.ref))


if __name__ == "__main__":
    main()
