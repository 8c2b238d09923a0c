"""The front page's figure: test accuracy against wall-clock seconds for every method of one
recorded emulated-cluster cell (by default MNIST-1D, 4 nodes x 1 process, 100 Mbit/s).

    python bench/plot_front_page.py                      # -> docs/img/time_to_accuracy.png
    python bench/plot_front_page.py --out /tmp/f.png --results bench/results/2026-12-02-who-wins
    python bench/plot_front_page.py --finish none         # the first panel alone

It reads what ``bench/cluster/compare.py`` (or ``decisive.py``, which runs it) recorded: a sweep
JSON file with ``rows``, one row per (workload, layout, rate, method) with the curve of the
repetition whose time to target is the median (``curve``) and every repetition's curve
(``per_repeat``). ``--results`` is such a file, or a folder searched (recursively) for the one
healthy sweep (no slow node, no added latency, no lost node) that holds the cell. Nothing is
run; only matplotlib is needed (the ``bench`` extra).

One curve per method: bold, the median repetition; faint, every repetition. A dotted line at
the sweep's target (65% test accuracy for MNIST-1D); the legend names each method as a user
knows it, ordered by time to the target, with that time. The time axis is logarithmic: on
the default cell DDP takes 25 times as long as the fastest method. ``--finish`` (a second
sweep of the same cell run to the end) adds a panel of the whole run, on a linear axis, whose
legend holds each method's final quality. The script prints the figure's caption.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "bench/results/2026-12-03-front"
DEFAULT_FINISH = REPO / "bench/results/2026-12-05-finish-cells/4x1-quiet-summary.json"
DEFAULT_OUT = REPO / "docs/img/time_to_accuracy.png"

# The names a user knows, with a fixed colour each. A key is a method id of
# bench/cluster/methods.py, or the start of ids that go on with "-" and a setting.
KNOWN: tuple[tuple[str, str, str], ...] = (
    ("ddp-powersgd", "DDP + PowerSGD hook", "#8c564b"),
    ("ddp", "PyTorch DDP", "#4d4d4d"),
    ("localsgd", "local SGD", "#1f77b4"),
    ("torchft-streaming-diloco", "streaming DiLoCo (torchft)", "#9467bd"),
    ("torchft-diloco", "DiLoCo (torchft)", "#2ca02c"),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp-cont", "qcomm SLOW_LINK", "#d62728"),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp", "qcomm SLOW_LINK, lockstep", "#ff9896"),
    ("slow-link", "qcomm SLOW_LINK", "#d62728"),
    ("adamw-slow-link", "qcomm ADAMW_SLOW_LINK", "#d62728"),
    ("qcomm-hier-4-h2f2-g100-n-ddp", "qcomm ADAMW_SLOW_LINK", "#d62728"),
    ("qcomm-hook", "qcomm DDP hook", "#ff7f0e"),
)
# The method ids of the peers (torch and torchft); every other method is one of qcomm's.
PEERS = ("ddp", "localsgd", "torchft")
OTHER_COLOURS = ("#e377c2", "#bcbd22", "#17becf", "#7f7f7f", "#aec7e8", "#ffbb78")
QUALITY = {"test_acc": ("test accuracy (%)", 100.0), "val_loss": ("validation loss", 1.0)}
WORKLOAD_NAMES = {"mnist1d": "MNIST-1D", "mnist1d-bn": "MNIST-1D (BatchNorm)",
                  "charlm": "charlm"}


@dataclass
class Series:
    """One method's curves in the figure."""

    method: str
    label: str  # the legend's text
    colour: str
    qcomm: bool
    median: list[tuple[float, float]]  # (seconds, quality) of the median repetition
    runs: list[list[tuple[float, float]]] = field(default_factory=list)  # every repetition
    time_to_target: float | None = None  # median over the repetitions; None: never
    final: float | None = None  # the final quality, median over the repetitions
    final_span: tuple[float, float] | None = None  # its [min, max]
    higher_is_better: bool = True  # accuracy; a loss: False


def name_of(method: str) -> tuple[str, str | None]:
    """A method id -> (the name a user knows, its colour or None). The setting beside the name
    (PowerSGD's rank, local SGD's period) comes from the id; unknown ids (and variants of the
    known ones, such as "ddp-fp16" or "assgd-4") are shown as they are."""
    for key, name, colour in KNOWN:
        if method != key and not method.startswith(key + "-"):
            continue
        rest = method[len(key) + 1:]
        if key == "ddp-powersgd" and rest.startswith("r") and rest[1:].isdigit():
            return f"{name}, rank {rest[1:]}", colour
        if key == "localsgd" and rest.startswith("p") and rest[1:].isdigit():
            return f"{name}, every {rest[1:]} steps", colour
        if key in ("ddp", *(k for k, _, _ in KNOWN if k.startswith("assgd"))) and rest:
            break  # another DDP (fp16 hook, ...) or another gossip setting: its id
        return name, colour
    return method, None


def _healthy(sweep: dict[str, Any]) -> bool:
    args = sweep.get("args") or {}
    return (not args.get("slow_nodes") and not args.get("delay_ms") and not args.get("kill_at")
            and not any(r.get("kill") or r.get("behaviour") for r in sweep.get("rows", [])))


def _cell_rows(sweep: dict[str, Any], workload: str, layout: str,
               rate: str) -> list[dict[str, Any]]:
    return [r for r in sweep.get("rows", []) if isinstance(r, dict)
            and r.get("workload", "mnist1d") == workload and r.get("layout") == layout
            and r.get("rate") == rate]


def find_sweep(results: Path, workload: str, layout: str,
               rate: str) -> tuple[Path, dict[str, Any]]:
    """The sweep file that holds the cell: ``results`` itself, or the one healthy sweep of the
    folder ``results`` that does. Raises ValueError (naming ``--results``) otherwise."""
    cell = f"{workload} {layout} {rate}"
    if results.is_file():
        candidates = [results]
    elif results.is_dir():
        candidates = sorted(results.rglob("*.json"))
    else:
        raise ValueError(f"--results {results}: no such file or folder")
    found = []
    for path in candidates:
        try:
            sweep = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            if results.is_file():
                raise ValueError(f"--results {results}: not a JSON file ({e})") from e
            continue
        if not isinstance(sweep, dict) or not isinstance(sweep.get("rows"), list):
            if results.is_file():
                raise ValueError(f"--results {results}: not a sweep of bench/cluster/compare.py"
                                 " (no 'rows')")
            continue
        if _cell_rows(sweep, workload, layout, rate) and (results.is_file() or _healthy(sweep)):
            found.append((path, sweep))
    if not found:
        where = "in it" if results.is_file() else "in any healthy sweep under it"
        raise ValueError(f"--results {results}: no rows of the cell {cell} {where}")
    if len(found) > 1:
        names = ", ".join(str(p) for p, _ in found)
        raise ValueError(f"--results {results}: several healthy sweeps hold the cell {cell} "
                         f"({names}); pass one file")
    return found[0]


def _points(curve: list[dict[str, Any]] | None, metric: str, scale: float) -> list[tuple]:
    return [(float(p["time_s"]), scale * float(p[metric])) for p in curve or []
            if p.get(metric) is not None and p.get("time_s") is not None]


def series(sweep: dict[str, Any], workload: str, layout: str, rate: str) -> list[Series]:
    """Every method of the cell, fastest to the target first; then those that never reach it
    (best final quality first); then those without an ok run (a legend entry, no curve)."""
    out: list[Series] = []
    spare = iter(OTHER_COLOURS * 4)
    for r in _cell_rows(sweep, workload, layout, rate):
        metric = r.get("metric", "test_acc")
        scale = QUALITY.get(metric, (metric, 1.0))[1]
        name, colour = name_of(r["method"])
        line = Series(method=r["method"], label=name, colour=colour or next(spare),
                      qcomm=not r["method"].startswith(PEERS), median=[],
                      higher_is_better=r.get("goal", "max") == "max")
        out.append(line)
        if r.get("status") != "ok":
            line.label = f"{name}: no run finished ({r.get('status')})"
            continue
        line.median = _points(r.get("curve"), metric, scale)
        line.runs = [_points(p.get("curve"), metric, scale) for p in r.get("per_repeat") or []
                     if p.get("status", "ok") == "ok"]
        if r.get("final") is not None:
            line.final = scale * float(r["final"])
            final_span = (r.get("spread") or {}).get("final")
            if final_span:
                line.final_span = (scale * final_span[0], scale * final_span[1])
        t = line.time_to_target = r.get("time_to_target_s")
        span = (r.get("spread") or {}).get("time_to_target_s")
        if t is None:
            line.label = f"{name}: never"
        elif span and len(line.runs) > 1:
            line.label = f"{name}: {t:.1f} s [{span[0]:.1f}-{span[1]:.1f}]"
        else:
            line.label = f"{name}: {t:.1f} s"

    def order(s: Series) -> tuple:
        final = s.median[-1][1] if s.median else 0.0
        return (not s.median, s.time_to_target is None, s.time_to_target or 0.0,
                -final if s.higher_is_better else final)

    return sorted(out, key=order)


def title_of(sweep: dict[str, Any], workload: str, layout: str, rate: str) -> str:
    nodes, _, procs = layout.partition("x")
    where = f"{nodes} nodes" + (f" x {procs} processes" if procs not in ("", "1") else "")
    speed = rate.replace("gbit", " Gbit/s").replace("mbit", " Mbit/s")
    cpus = (sweep.get("environment") or {}).get("cpus")
    emulated = f"emulated on {cpus} CPU cores" if cpus else "emulated cluster"
    return (f"{WORKLOAD_NAMES.get(workload, workload)}, {where}, {speed} between nodes "
            f"({emulated})")


def target_of(sweep: dict[str, Any], workload: str) -> float | None:
    args = sweep.get("args") or {}
    target = (sweep.get("targets_quality") or {}).get(workload, args.get("target"))
    return None if target is None else float(target)


def _sprint_panel(ax: Any, lines: list[Series], title: str, target: float | None,
                  metric: str) -> None:
    """Quality against seconds on a log axis, the target dotted, the legend by time to it."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    scale = QUALITY.get(metric, (metric, 1.0))[1]
    ends = [pts[-1][0] for s in lines for pts in [s.median, *s.runs] if pts]
    xmax = max(ends, default=10.0) * 1.1
    xmin = 0.5
    _curves(ax, lines)
    for s in lines:
        if s.time_to_target is not None and target is not None:
            ax.plot([s.time_to_target], [scale * target], "o", color=s.colour, ms=5, zorder=5)
    if target is not None:
        ax.axhline(scale * target, color="black", lw=0.9, ls=":", zorder=1)
        ax.annotate(f"target {scale * target:g}%" if metric == "test_acc" else
                    f"target {target:g}", xy=(xmin, scale * target), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(xmin, xmax)
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if xmin <= t <= xmax]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    _y_range(ax, lines, metric, xmin)
    ax.set_xlabel("wall-clock seconds (log scale)")
    n = max((len(s.runs) for s in lines), default=1)
    goal = (f"{scale * target:g}%" if metric == "test_acc" else f"{target:g}") if target else "?"
    heading = f"seconds to {goal}, median of {n} runs [min-max]" if n > 1 else f"seconds to {goal}"
    _finish_axes(ax, title, metric, heading)


def _finish_panel(ax: Any, lines: list[Series], title: str, metric: str) -> None:
    """The whole run on a linear axis (its end is where the verdict on the final model is
    taken), the legend by final quality, the best first."""
    _curves(ax, lines, label=lambda s: _final_label(s, metric))
    ends = [pts[-1][0] for s in lines for pts in [s.median, *s.runs] if pts]
    ax.set_xlim(0, max(ends, default=10.0) * 1.02)
    # The finish is decided in the last points: the axis starts where the slowest curve is
    # past half of the best final, so that the top of the climb fills the panel.
    _y_range(ax, lines, metric, 0.0, floor=0.5 * max((s.final or 0.0 for s in lines),
                                                    default=0.0))
    ax.set_xlabel("wall-clock seconds")
    n = max((len(s.runs) for s in lines), default=1)
    heading = f"final, median of {n} runs [min-max]" if n > 1 else "final"
    _finish_axes(ax, title, metric, heading)


def _final_label(s: Series, metric: str) -> str:
    name = name_of(s.method)[0]
    if s.final is None:
        return f"{name}: no final"
    unit = "%" if metric == "test_acc" else ""
    span = f" [{s.final_span[0]:.1f}-{s.final_span[1]:.1f}]" if s.final_span and \
        len(s.runs) > 1 else ""
    return f"{name}: {s.final:.1f}{unit}{span}" if metric == "test_acc" else \
        f"{name}: {s.final:.4f}{span}"


def _curves(ax: Any, lines: list[Series], label: Any = None) -> None:
    """Every repetition faint, the median one bold (qcomm's bolder and on top)."""
    for s in lines:
        for pts in s.runs:
            pts = [p for p in pts if p[0] > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=s.colour, lw=0.8,
                    alpha=0.3, zorder=2)
        pts = [p for p in s.median if p[0] > 0]  # none: a legend entry alone
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=s.colour,
                lw=2.6 if s.qcomm else 1.8, label=s.label if label is None else label(s),
                zorder=4 if s.qcomm else 3)


def _y_range(ax: Any, lines: list[Series], metric: str, xmin: float,
             floor: float | None = None) -> None:
    """Accuracy's axis from the lowest point shown (or ``floor``) to above the highest: in
    steps of 5 points, or, for a panel that starts at ``floor``, one point over the top (the
    finish is read in the last points)."""
    if metric != "test_acc":
        return
    ys = [p[1] for s in lines for pts in [s.median, *s.runs] for p in pts if p[0] >= xmin]
    if floor is None:
        ax.set_ylim(max(0.0, 5 * (min(ys, default=0.0) // 5)),
                    5 * (max(ys, default=100) // 5 + 1))
        return
    low = max(floor, min(ys, default=0.0))
    ax.set_ylim(max(0.0, 5 * (low // 5)), min(100.0, math.ceil(max(ys, default=99.0)) + 1))


def _finish_axes(ax: Any, title: str, metric: str, heading: str) -> None:
    ax.set_ylabel(QUALITY.get(metric, (metric, 1.0))[0])
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", color="#dddddd", lw=0.6)
    legend = ax.legend(title=heading, fontsize=8, title_fontsize=8, loc="lower right",
                       framealpha=0.95)
    legend.set_zorder(6)


def figure(lines: list[Series], title: str, target: float | None, metric: str = "test_acc",
           finish: tuple[list[Series], str] | None = None):
    """The matplotlib Figure (Agg) of ``lines``; its legend holds one entry per Series.
    ``finish``: (the series of a run to the end, its title), drawn in a second panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if finish is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        _sprint_panel(ax, lines, title, target, metric)
    else:
        fig, (ax, ax_end) = plt.subplots(1, 2, figsize=(14, 4.8))
        _sprint_panel(ax, lines, title, target, metric)
        _finish_panel(ax_end, finish[0], finish[1], metric)
    fig.tight_layout()
    return fig


def caption(sweep_path: Path, target: float | None, repeats: int,
            metric: str = "test_acc") -> str:
    """What the figure shows, in words: for the page that shows it."""
    what = "Test accuracy" if metric == "test_acc" else QUALITY.get(metric, (metric,))[0]
    if target is None:
        goal = "the target"
    else:
        goal = f"{100 * target:g}% test accuracy" if metric == "test_acc" else f"{target:g}"
    return (f"{what} of the nodes' average model against wall-clock seconds (log scale), "
            f"one colour per method. Bold: the repetition with the median time to {goal} "
            f"(of {repeats}); faint: every repetition; dots: where the bold curve first reaches "
            f"the target (dotted line). Each peer at the best setting of its own grid. Data: "
            f"{sweep_path}.")


def finish_caption(sweep_path: Path, steps: int | None) -> str:
    """What the second panel shows, in words."""
    length = f"{steps} steps of the fastest node" if steps else "its end"
    return (f"Right: the same cell run to {length} (linear axis), the methods that lead it; "
            f"the legend holds each one's final quality, median of its repetitions [min-max]. "
            f"Data: {sweep_path}.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="A sweep JSON file of bench/cluster/compare.py, or a folder searched "
                        "for the one healthy sweep of the cell (default "
                        f"{DEFAULT_RESULTS.relative_to(REPO)}).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"The PNG to write (default {DEFAULT_OUT.relative_to(REPO)}; its folder "
                        "is created).")
    p.add_argument("--finish", default=str(DEFAULT_FINISH.relative_to(REPO)),
                   help="A sweep of the same cell run to the end (its JSON file, or a folder "
                        "as --results), drawn as a second panel; 'none': the first panel alone "
                        f"(default {DEFAULT_FINISH.relative_to(REPO)}).")
    p.add_argument("--workload", default="mnist1d", help="The cell's workload (mnist1d).")
    p.add_argument("--layout", default="4x1",
                   help="The cell's layout, NODESxPROCS (default 4x1).")
    p.add_argument("--rate", default="100mbit",
                   help="The cell's inter-node rate, as the sweep names it (default 100mbit).")
    p.add_argument("--dpi", type=int, default=100,
                   help="Pixels per inch of the 8 x 4.5 in figure (default 100).")
    return p


def save_png(fig: Any, out: Path, dpi: int) -> None:
    """``fig`` as a PNG of at most 256 colours (a third of the bytes of matplotlib's RGBA for
    a line plot, which the repository keeps); Pillow comes with matplotlib."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as image:
        image.convert("RGB").quantize(256).save(out, optimize=True)


def _shown(path: Path) -> Path:
    """``path`` as a caption names it: relative to the repository when inside it."""
    try:
        return path.resolve().relative_to(REPO)
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        path, sweep = find_sweep(args.results, args.workload, args.layout, args.rate)
    except ValueError as e:
        parser.error(str(e))
    finish = None
    if args.finish != "none":
        finish_path = Path(args.finish)
        if not finish_path.is_absolute() and not finish_path.exists():
            finish_path = REPO / finish_path
        try:
            finish_path, finish_sweep = find_sweep(finish_path, args.workload, args.layout,
                                                   args.rate)
        except ValueError as e:
            parser.error(str(e).replace("--results", "--finish"))
        steps = (finish_sweep.get("args") or {}).get("steps")
        finish = (series(finish_sweep, args.workload, args.layout, args.rate),
                  f"the same cell run to the end ({steps} steps of the fastest node)"
                  if steps else "the same cell run to the end")
    lines = series(sweep, args.workload, args.layout, args.rate)
    rows = _cell_rows(sweep, args.workload, args.layout, args.rate)
    metric = rows[0].get("metric", "test_acc")
    target = target_of(sweep, args.workload)
    fig = figure(lines, title_of(sweep, args.workload, args.layout, args.rate), target, metric,
                 finish)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, args.out, args.dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    repeats = round(statistics.median([r.get("repeats_ok") or 1 for r in rows]))
    print(caption(_shown(path), target, repeats, metric))
    if finish is not None:
        print(finish_caption(_shown(finish_path), steps))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
