"""The figures of bench/results/2026-12-04-rejoin-peers.md from this folder's
summaries: per sweep and method, the seconds to each accuracy and the accuracy at fixed times
(the nodes' average, median [min-max] of the 3 repetitions, from each summary's
per-repetition curves), the final accuracy, the lost node's return (seconds from its loss and
from its restart to its first step, the running nodes' step rate during the join against their
rate before the loss) and each method's time to each accuracy against its own run without a
loss (ratio of the medians).

    python bench/results/2026-12-04-rejoin-peers/curves.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
NO_LOSS = ("noloss", "noloss-ddp", "noloss-diloco")
SWEEPS = ("back-at-6s", "back-at-15s", "heal-back-at-6s", "heal2-back-at-6s", "heal-back-at-15s")
TARGETS = (0.60, 0.65, 0.70, 0.76)
TIMES = (5, 10, 15, 20, 25, 30)


def seconds_to(curve: list[dict], target: float) -> float | None:
    return next((p["time_s"] for p in curve if p["test_acc"] >= target), None)


def accuracy_at(curve: list[dict], t: float) -> float | None:
    seen = [p["test_acc"] for p in curve if p["time_s"] <= t]
    return seen[-1] if seen else None


def median_of(xs: list[float | None]) -> float | None:
    """The median, a repetition that never got there counting as infinitely slow."""
    if sum(x is None for x in xs) * 2 >= len(xs):
        return None
    return statistics.median(float("inf") if x is None else x for x in xs)


def spread(xs: list[float | None], fmt: str) -> str:
    got = [x for x in xs if x is not None]
    if not got:
        return "never"
    out = f"{statistics.median(got):{fmt}} [{min(got):{fmt}}-{max(got):{fmt}}]"
    return out + (f" ({len(got)} of {len(xs)})" if len(got) < len(xs) else "")


def rows(name: str) -> dict[str, dict]:
    path = HERE / name / "summary.json"
    if not path.exists():
        return {}
    return {r["method"]: r for r in json.loads(path.read_text())["rows"]}


def main() -> None:
    base = {m: r for name in NO_LOSS for m, r in rows(name).items()}
    for name in (*NO_LOSS, *SWEEPS):
        for method, row in rows(name).items():
            reps = [r for r in row.get("per_repeat", []) if r.get("curve")]
            curves = [r["curve"] for r in reps]
            print(f"== {name} {method}: {row.get('behaviour', 'no loss')} "
                  f"({len(reps)} runs)")
            ref = [r["curve"] for r in base.get(method, {}).get("per_repeat", [])
                   if r.get("curve")]
            for target in TARGETS:
                mine = [seconds_to(c, target) for c in curves]
                line = f"  s to {target:.0%}: {spread(mine, '.1f')}"
                if name in SWEEPS and ref:
                    a, b = median_of(mine), median_of([seconds_to(c, target) for c in ref])
                    if a is not None and b is not None:
                        line += f"  ({a / b:.2f}x its run without a loss)"
                print(line)
            print("  at " + ", ".join(f"{t} s {spread([accuracy_at(c, t) for c in curves], '.3f')}"
                                      for t in TIMES))
            print(f"  final: {spread([r['final'] for r in reps], '.3f')}")
            back = [r.get("rejoin") or {} for r in reps]
            if any(back):
                for key in ("kill_to_first_step_s", "restart_to_first_step_s",
                            "running_rate_vs_before_join_min", "running_rate_vs_before_join_median",
                            "running_rate_vs_before_kill_min",
                            "running_rate_vs_before_kill_median"):
                    print(f"  {key}: {spread([b.get(key) for b in back], '.2f')}")


if __name__ == "__main__":
    main()
