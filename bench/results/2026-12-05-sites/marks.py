"""Seconds to 65% and 75% test accuracy (of the nodes' average, bench/cluster's curve) and the
final accuracy of every run in this folder, per kind of links: each run's line, then a table
row of median [min-max]. ``python bench/results/2026-12-05-sites/marks.py [FOLDER]``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository

from bench.cluster.run_summary import time_to_target


def spread(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{statistics.median(got):.2f} [{min(got):.2f}-{max(got):.2f}]"


def main() -> None:
    folder = Path(sys.argv[1]) if sys.argv[1:] else Path(__file__).resolve().parent
    for links in ("world", "gloo", "sockets"):
        t65: list[float | None] = []
        t75: list[float | None] = []
        final: list[float | None] = []
        for f in sorted(folder.glob(f"seed*-{links}/runs/*.json")):
            run = json.loads(f.read_text())
            t65.append(time_to_target(run["curve"], 0.65))
            t75.append(time_to_target(run["curve"], 0.75))
            final.append(100 * run["final_test_acc"])
            print(f"  {f.parts[-3]}: 65% {t65[-1]} s, 75% {t75[-1]} s, final {final[-1]:.2f}%")
        print(f"| {links} | {len(final)} | {spread(t65)} | {spread(t75)} | {spread(final)} |")


if __name__ == "__main__":
    main()
