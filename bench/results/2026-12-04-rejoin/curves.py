"""The figures of bench/results/2026-12-04-rejoin.md from this folder's files: per sweep, the
seconds to each accuracy and the accuracy at fixed times (the nodes' average, median [min-max]
of the 3 repetitions, from each summary's per-repetition curves), the final accuracy, and for
the runs kept whole (``runs/``) the running nodes' stalls around each join.

    python bench/results/2026-12-04-rejoin/curves.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEPS = ("noloss", "lost", "rejoin2", "early-lost", "early-rejoin")


def seconds_to(curve: list[dict], target: float) -> float | None:
    return next((p["time_s"] for p in curve if p["test_acc"] >= target), None)


def accuracy_at(curve: list[dict], t: float) -> float | None:
    seen = [p["test_acc"] for p in curve if p["time_s"] <= t]
    return seen[-1] if seen else None


def spread(xs: list[float | None], fmt: str) -> str:
    got = [x for x in xs if x is not None]
    if not got:
        return "never"
    out = f"{statistics.median(got):{fmt}} [{min(got):{fmt}}-{max(got):{fmt}}]"
    return out + (f" ({len(got)} of {len(xs)})" if len(got) < len(xs) else "")


def stalls(run: dict) -> str:
    """Per running rank: the seconds of steps it lost from the joiner's build start until 2 s
    after its first step (at its rate in the 2 s before), and its steps over 50 ms then."""
    t = next(r for r in run["ranks"] if r.get("timeline"))["timeline"]
    lo, hi = t["build_start"], t["first_step_end"] + 2.0
    out = []
    for r in run["ranks"]:
        if r.get("timeline"):
            continue
        e = r["step_ends"]
        rate = sum(lo - 2 <= v < lo for v in e) / 2
        lost = (hi - lo) - sum(lo <= v < hi for v in e) / rate
        long = [f"{e[i] - lo:.2f}s:{e[i] - e[i - 1]:.3f}" for i in range(1, len(e))
                if lo <= e[i] < hi and e[i] - e[i - 1] > 0.05]
        out.append(f"rank {r['rank']} lost {lost:.2f} s, long steps {long}")
    return f"first step {t['first_step_end'] - lo:.2f} s after build start; " + "; ".join(out)


def main() -> None:
    for name in SWEEPS:
        row = json.loads((HERE / name / "summary.json").read_text())["rows"][0]
        curves = [r["curve"] for r in row["per_repeat"]]
        print(f"== {name}: {row.get('behaviour', 'no loss')}")
        for target in (0.70, 0.76, 0.78):
            print(f"  s to {target:.0%}: {spread([seconds_to(c, target) for c in curves], '.1f')}")
        for t in (10, 15, 20, 25, 30):
            print(f"  at {t} s: {spread([accuracy_at(c, t) for c in curves], '.3f')}")
        print(f"  final: {spread([r['final'] for r in row['per_repeat']], '.3f')}")
        for run in sorted((HERE / name / "runs").glob("*.json")):
            print(f"  {run.name[-7:-5]}: {stalls(json.loads(run.read_text()))}")


if __name__ == "__main__":
    main()
