"""Verdicts that should hold on another machine of the same kind: for every cell of a sweep, each
method's time to several targets (an easy one every method reaches, the usual one, one near the
best final quality, and the cell's ceiling: the best final any method reaches, less half a point
of accuracy or plus 1% of loss), its quality at fixed wall-clock budgets, its final and its best
quality, and whether it ended at its best or peaked and declined, each as the median over the
repetitions with its [min-max] spread; then, per column, who is first, by how much, whether the
spreads are apart (else it is a tie) and how much margin the win has. Then each method's quality
at equal work: when the nodes have taken a given number of steps each on average (nodes at
different paces, as wait-free ones, have seen the same samples as a lockstep run there).

    python bench/cluster/verdicts.py OUT/healthy/summary.json [--json OUT/verdicts.json]

The quality judged is that of the model a user would keep if they stopped there: the snapshot
the run evaluated last at or before that time (for gossip, the nodes' average, which is what
``workload.py`` evaluates for every method alike). A repetition that never reaches a target
counts as infinitely slow. Margin: a win whose first crossing of the target comes in the last
tenth of a run (of the time its curve spans) has none; another machine can flip it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.run_summary import time_to_target

INF = float("inf")
# A crossing later than this fraction of the run leaves the win no margin.
LAST_TENTH = 0.9
# The cell's ceiling: the best final quality any method of the cell reaches, less half a point
# of accuracy or plus 1% of loss; a method that ends that far below its own best "declines".
CEILING_POINTS = 0.005
CEILING_LOSS = 0.01


@dataclass(frozen=True)
class Goals:
    """What a workload's verdicts ask: ``targets`` (qualities, easiest first) and ``budgets_s``
    (wall-clock seconds since the timed window opened)."""

    targets: tuple[float, ...]
    budgets_s: tuple[float, ...]


# MNIST-1D: 60% every method of the table reaches (PowerSGD ends near 69%), 65% the usual
# target, 72% near the best final accuracy (74-77%). charlm: 2.00 every method reaches, 1.90
# the usual target, 1.80 near DDP's final 1.73. Budgets span the healthy runs' lengths.
GOALS: dict[str, Goals] = {
    "mnist1d": Goals(targets=(0.60, 0.65, 0.72), budgets_s=(2.0, 4.0, 8.0)),
    # The CNN with BatchNorm learns MNIST-1D further (every method ends near 96%).
    "mnist1d-bn": Goals(targets=(0.80, 0.90, 0.95), budgets_s=(4.0, 8.0, 16.0)),
    "charlm": Goals(targets=(2.00, 1.90, 1.80), budgets_s=(30.0, 60.0, 90.0)),
}


def crossing(curve: Sequence[dict[str, float]], target: float, metric: str,
             goal: str) -> tuple[float, float] | None:
    """(time_s, fraction of the run) of the first snapshot reaching ``target``; None if none
    does. The fraction is that time over the time of the curve's last snapshot."""
    t = time_to_target(curve, target, metric, goal)
    if t is None:
        return None
    end = curve[-1]["time_s"]
    return t, (t / end if end > 0 else 1.0)


def best_of(curve: Sequence[dict[str, float]], metric: str, goal: str) -> float | None:
    """The best quality any snapshot of ``curve`` reached; None for an empty curve."""
    values = [p[metric] for p in curve]
    if not values:
        return None
    return max(values) if goal == "max" else min(values)


def declined(best: float, final: float, goal: str) -> bool:
    """Whether a run that reached ``best`` and ended at ``final`` lost more than the ceiling's
    margin on the way (half a point of accuracy, 1% of loss)."""
    if goal == "max":
        return best - final > CEILING_POINTS + 1e-12
    return final > best * (1 + CEILING_LOSS) + 1e-12


def ceiling_of(finals: Sequence[float], goal: str) -> float | None:
    """The cell's ceiling mark from its methods' median finals: the best less the margin."""
    if not finals:
        return None
    if goal == "max":
        return round(max(finals) - CEILING_POINTS, 6)
    return round(min(finals) * (1 + CEILING_LOSS), 6)


def quality_at(curve: Sequence[dict[str, float]], budget_s: float, metric: str) -> float | None:
    """The quality of the last snapshot taken at or before ``budget_s``; None when none was.
    A run that ended earlier keeps its last (final) snapshot."""
    kept = None
    for point in curve:
        if point["time_s"] > budget_s:
            break
        kept = point[metric]
    return kept


@dataclass(frozen=True)
class Spread:
    """Median over ``n`` repetitions with [min, max]; ``lower_better`` says which way wins.
    Times that never happened are ``inf``; qualities never measured are left out."""

    median: float
    low: float
    high: float
    lower_better: bool
    n: int = 1

    @classmethod
    def of(cls, values: Sequence[float], lower_better: bool) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), lower_better,
                   len(values))

    @property
    def rank(self) -> float:
        """Sort key: smaller is better whichever way ``lower_better`` points."""
        return self.median if self.lower_better else -self.median

    def beats(self, other: Spread) -> bool:
        """Every repetition of ``self`` better than every one of ``other`` (spreads apart)."""
        return self.high < other.low if self.lower_better else self.low > other.high

    def text(self, spec: str, scale: float = 1.0) -> str:
        def f(v: float) -> str:
            return "never" if v == INF else format(v * scale, spec)
        if self.median == INF:
            got = "" if self.low == INF else f" (fastest {f(self.low)})"
            return "never" + got
        if self.low == self.high:
            return f(self.median)
        return f"{f(self.median)} [{f(self.low)}-{f(self.high)}]"


def repeat_curves(row: dict[str, Any]) -> list[list[dict[str, float]]]:
    """The ok repetitions' curves of a cell row (the median one only for older summaries)."""
    reps = [r for r in row.get("per_repeat") or [] if r.get("status", "ok") == "ok"]
    curves = [r["curve"] for r in reps if r.get("curve") is not None]
    return curves if curves and len(curves) == len(reps) else [row.get("curve") or []]


def cell_figures(row: dict[str, Any], goals: Goals) -> dict[str, Any]:
    """One method's figures in one cell: per target the time Spread and the latest crossing
    fraction over the repetitions, per budget the quality Spread, the final quality Spread."""
    metric, goal = row.get("metric", "test_acc"), row.get("goal", "max")
    curves = repeat_curves(row)
    times, fractions = {}, {}
    for target in goals.targets:
        cross = [crossing(c, target, metric, goal) for c in curves]
        times[target] = Spread.of([INF if x is None else x[0] for x in cross], True)
        got = [x[1] for x in cross if x is not None]
        fractions[target] = max(got) if got else None
    lower = goal == "min"
    quality = {b: Spread.of([q for c in curves if (q := quality_at(c, b, metric)) is not None],
                            lower) for b in goals.budgets_s}
    reps = [r for r in row.get("per_repeat") or [] if r.get("status", "ok") == "ok"]
    finals = [r["final"] for r in reps if r.get("final") is not None]
    final = Spread.of(finals or ([row["final"]] if row.get("final") is not None else []), lower)
    # the best a repetition reached (its final counts: it may be evaluated after the curve's
    # last snapshot), and how far it ended below that
    pairs = [(b, r["final"]) for r in reps if r.get("final") is not None
             and (b := best_of([*(r.get("curve") or []), {metric: r["final"]}], metric, goal))
             is not None]
    best = Spread.of([b for b, _ in pairs], lower)
    drop = Spread.of([abs(b - f) for b, f in pairs], True)
    declines = sum(declined(b, f, goal) for b, f in pairs)
    work = {int(m): Spread.of(got, lower) if (got := [q for c in curves if (
        q := quality_at_work(c, int(m), metric)) is not None]) else None
        for m in row.get("quality_at_steps") or {}}
    return {"method": row["method"], "metric": metric, "goal": goal, "times": times,
            "fractions": fractions, "quality": quality, "final": final, "best": best,
            "drop": drop, "declines": declines, "repeats": len(pairs), "work": work}


def shape_text(f: dict[str, Any], spec: str, scale: float) -> str:
    """How a method's run ended against its best, in words: "ends at its best" or "peaks,
    then declines by X" (with how many repetitions did), from :func:`cell_figures`."""
    if f["drop"] is None:
        return "-"
    if not f["declines"]:
        return "ends at its best"
    of = "" if f["declines"] == f["repeats"] else f" ({f['declines']} of {f['repeats']})"
    return f"peaks, then declines by {f['drop'].text(spec, scale)}{of}"


def quality_at_work(curve: Sequence[dict[str, float]], steps: int,
                    metric: str) -> float | None:
    """The quality of the first snapshot at which the nodes have taken ``steps`` steps each on
    average (a curve point's ``step``: the mean over the nodes), None when the run stopped
    short of it: the same samples seen, however they fell between the nodes."""
    point = next((p for p in curve if p["step"] >= steps - 1e-9), None)
    return None if point is None else point[metric]


def judge(spreads: dict[str, Spread | None], kind: str = "time") -> dict[str, Any]:
    """Who is first among ``method -> Spread`` (None: no figure): ``winner``, ``ties`` (the
    methods whose spread overlaps the winner's), ``runner`` (the next by median), ``ratio``
    (times: the runner's median over the winner's; qualities: the difference of the medians,
    positive) and ``apart`` (no ties, and every figure from at least two repetitions: one run
    per method has no spread to judge by; ``spread_known`` says which)."""
    have = {m: s for m, s in spreads.items() if s is not None and s.median != INF}
    if not have:
        return {"winner": None, "ties": [], "runner": None, "ratio": None, "apart": False,
                "spread_known": False}
    order = sorted(have, key=lambda m: have[m].rank)
    win = order[0]
    rest = [m for m in spreads if m != win and spreads[m] is not None]
    ties = [m for m in rest if not spreads[m].beats(have[win]) and not have[win].beats(spreads[m])]
    runner = order[1] if len(order) > 1 else None
    ratio = None
    if runner is not None:
        a, b = have[win].median, have[runner].median
        ratio = (b / a if a > 0 else None) if kind == "time" else abs(a - b)
    known = all(s.n >= 2 for s in spreads.values() if s is not None)
    return {"winner": win, "ties": ties, "runner": runner, "ratio": ratio,
            "apart": known and not ties, "spread_known": known}


def verdict_text(j: dict[str, Any], kind: str, fraction: float | None = None,
                 unit: str = "") -> str:
    """One verdict in words; ``kind`` "time" or "quality"; ``fraction``: the winner's latest
    crossing of the target (times only); ``unit`` follows a quality difference."""
    if j["winner"] is None:
        return "nobody"
    if j["runner"] is None:
        text = f"{j['winner']} alone"
    elif kind == "time":
        text = f"{j['winner']} {j['ratio']:.2f}x" if j["ratio"] else j["winner"]
    else:
        text = f"{j['winner']} by {j['ratio']:.2g}{unit}"
    if not j["spread_known"]:
        text += ", one curve per method: no spread"
    elif j["apart"]:
        text += ", spreads apart"
    else:
        text += f", tie with {', '.join(j['ties'])}"
    if kind == "time" and fraction is not None and fraction > LAST_TENTH:
        text += f"; no margin (crosses at {100 * fraction:.0f}% of its run)"
    return text


def is_qcomm(method: str) -> bool:
    """Whether a bench method name is one of qcomm's (``assgd-...``, ``qcomm-...``)."""
    return method.startswith(("assgd", "qcomm"))


def _best(figs: Sequence[dict[str, Any]], get: Any) -> dict[str, Spread | None]:
    """The one method of ``figs`` whose figure ``get(f)`` has the best median (none if no
    figure), as ``{method: Spread}`` for :func:`judge`."""
    have = [(f["method"], get(f)) for f in figs if get(f) is not None]
    return dict([min(have, key=lambda mv: mv[1].rank)]) if have else {}


def verdict_row(figs: Sequence[dict[str, Any]], goals: Goals, acc: bool,
                pick: tuple[Sequence[dict], Sequence[dict]] | None = None) -> list[dict]:
    """The verdicts of one cell, one per target, budget and the final quality; with ``pick``
    (qcomm's figures, the peers' figures) only the best of each side is judged."""
    out = []

    def spreads(get: Any) -> dict[str, Spread | None]:
        if pick is None:
            return {f["method"]: get(f) for f in figs}
        return {**_best(pick[0], get), **_best(pick[1], get)}

    fraction = {f["method"]: f["fractions"] for f in figs}
    for t in goals.targets:
        j = judge(spreads(lambda f, t=t: f["times"][t]))
        frac = fraction[j["winner"]][t] if j["winner"] else None
        out.append({"goal": f"time to {t:g}", **j, "winner_fraction": frac,
                    "text": verdict_text(j, "time", frac)})
    unit = " points" if acc else ""
    for name, get in [*[(f"quality at {b:g} s", lambda f, b=b: f["quality"][b])
                        for b in goals.budgets_s], ("final", lambda f: f["final"]),
                      ("best", lambda f: f["best"])]:
        j = judge(spreads(get), "quality")
        if j["ratio"] is not None and acc:
            j["ratio"] *= 100.0
        out.append({"goal": name, **j, "text": verdict_text(j, "quality", unit=unit)})
    return out


def row_line(label: str, verdicts: Sequence[dict[str, Any]]) -> str:
    """A table line of verdicts in words."""
    return "| " + " | ".join([label, *(v["text"] for v in verdicts)]) + " |"


def cell_table(rows: Sequence[dict[str, Any]], goals: Goals) -> tuple[str, list[dict]]:
    """Markdown table of one (workload, layout, rate) cell: one line per method, one column per
    target and budget and the final quality, and a verdict line; with the verdicts as data."""
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    figs = [cell_figures(r, goals) for r in ok]
    if not figs:
        return "(no ok runs)", []
    acc = figs[0]["metric"] == "test_acc"
    q_spec, q_scale = (".1f", 100.0) if acc else (".3f", 1.0)
    unit = "%" if acc else ""
    # the cell's ceiling: a mark near the best final any method reaches, judged as a target
    top = ceiling_of([f["final"].median for f in figs if f["final"]], figs[0]["goal"])
    if top is not None and top not in goals.targets:
        goals = Goals((*goals.targets, top), goals.budgets_s)
        figs = [cell_figures(r, goals) for r in ok]
    head = ["method", *[f"s to {t * q_scale:g}{unit}" + (" (ceiling)" if t == top else "")
                        for t in goals.targets],
            *[f"{unit or 'loss'} at {b:g} s" for b in goals.budgets_s], "final", "best",
            "end of the run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figs:
        cols = [f["method"]]
        cols += [f["times"][t].text(".1f") for t in goals.targets]
        cols += [f["quality"][b].text(q_spec, q_scale) if f["quality"][b] else "-"
                 for b in goals.budgets_s]
        cols += [f[k].text(q_spec, q_scale) if f[k] else "-" for k in ("final", "best")]
        cols.append(shape_text(f, q_spec, q_scale))
        lines.append("| " + " | ".join(cols) + " |")
    verdicts = verdict_row(figs, goals, acc)
    lines.append(row_line("**verdict**", verdicts))
    lines += work_lines(figs, q_spec, q_scale)
    ours = [f for f in figs if is_qcomm(f["method"])]
    peers = [f for f in figs if not is_qcomm(f["method"])]
    if ours and peers:
        # qcomm's best against the best peer, column by column: the comparison a user makes
        # when choosing a library, whichever of qcomm's own settings is first.
        against = [{**v, "scope": "qcomm vs the best peer"} for v in
                   verdict_row(figs, goals, acc, pick=(ours, peers))]
        lines.append(row_line("**qcomm vs the best peer**", against))
        verdicts += against
    return "\n".join(lines), verdicts


def work_lines(figs: Sequence[dict[str, Any]], spec: str, scale: float) -> list[str]:
    """The quality at equal work (the nodes' mean steps) of every method, as table lines after
    a blank one; none when the summary has no marks. A method whose nodes step at different
    paces ends (at the fastest node's steps) with fewer steps on average: "-" past its end."""
    marks = sorted({m for f in figs for m in f["work"]})
    if not marks:
        return []
    head = ["method", *[f"at {m} steps each" for m in marks]]
    out = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figs:
        cells = [f["work"][m].text(spec, scale) if f["work"].get(m) else "-" for m in marks]
        out.append("| " + " | ".join([f["method"], *cells]) + " |")
    return out


def report(summary: dict[str, Any], goals: dict[str, Goals] | None = None) -> tuple[str, dict]:
    """Every cell of a compare.py summary: its table in markdown, and the verdicts by cell."""
    goals = goals or GOALS
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for row in summary["rows"]:
        cells.setdefault((row.get("workload", "mnist1d"), row["layout"], row["rate"]),
                         []).append(row)
    parts, data = [], {}
    for (w, layout, rate), rows in cells.items():
        md, verdicts = cell_table(rows, goals[w])
        parts.append(f"### {w}, {layout}, {rate}\n\n{md}")
        data[f"{w} {layout} {rate}"] = verdicts
    env = summary.get("environment", {})
    parts.append(f"{env.get('cpu', '?')}, {env.get('cpus', '?')} CPUs, load at start "
                 f"{env.get('loadavg_at_start')}; medians of the ok repetitions [min-max]; "
                 f"a crossing after {100 * LAST_TENTH:.0f}% of a run has no margin.")
    return "\n\n".join(parts), data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("summary", help="A compare.py summary.json.")
    p.add_argument("--json", default="", help="Also write the verdicts, by cell, here.")
    p.add_argument("--targets", default="",
                   help="The targets judged, a comma list of qualities, easiest first (e.g. "
                        "2.4,2.3,2.2 for a charlm run of another size or length); left out: "
                        "each workload's own (" + "; ".join(
                            f"{w} {', '.join(f'{t:g}' for t in g.targets)}"
                            for w, g in GOALS.items()) + ").")
    p.add_argument("--budgets", default="",
                   help="The wall-clock budgets judged, a comma list of seconds; left out: each "
                        "workload's own. Given with --targets.")
    args = p.parse_args(argv)
    goals = None
    if bool(args.targets) != bool(args.budgets):
        p.error("--targets and --budgets go together (a run of another size or length needs "
                "both)")
    if args.targets:
        try:
            own = Goals(tuple(float(v) for v in args.targets.split(",")),
                        tuple(float(v) for v in args.budgets.split(",")))
        except ValueError as e:
            p.error(f"--targets / --budgets: comma lists of numbers, got {args.targets!r} and "
                    f"{args.budgets!r} ({e})")
        if any(b <= 0 for b in own.budgets_s):
            p.error(f"--budgets must be seconds > 0, got {args.budgets!r}")
        goals = {w: own for w in GOALS}
    try:
        summary = json.loads(Path(args.summary).read_text())
    except (OSError, ValueError) as e:
        p.error(f"summary: cannot read a compare.py summary.json from {args.summary!r}: {e}")
    if not isinstance(summary, dict) or not isinstance(summary.get("rows"), list):
        p.error(f"summary: {args.summary!r} has no 'rows' list; give a compare.py summary.json")
    md, data = report(summary, goals)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
