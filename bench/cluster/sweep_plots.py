"""The PNG plots of a sweep: per (workload, layout, rate), quality against wall-clock time for
every method, and the inter-node bytes per step.

matplotlib is imported only when a plot is drawn; imported by compare.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M

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


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/sweep_plots.py is a library of the cluster benchmark "
        "(the plots a sweep draws), imported by compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
