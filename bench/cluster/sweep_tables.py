"""The tables of a sweep on the terminal: every cell (median [min-max] over the repetitions),
the quality at equal steps and at equal work, and with a lost node what each method did and,
for a node that came back, what its return cost.

Pure Python; imported by compare.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster.run_summary import REJOIN_FIELDS


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if v >= div:
            return f"{v / div:.2f} {unit}"
    return f"{v:.0f} B"


def fmt(v: float | None, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def fmt_spread(v: float | None, spread: Sequence[float] | None, spec: str, scale: float = 1.0,
               none: str = "-") -> str:
    """``median [min-max]`` (the spread only when it differs from the median)."""
    text = fmt(None if v is None else v * scale, spec, none)
    if spread and v is not None and spread[0] != spread[1]:
        text += f" [{spread[0] * scale:{spec}}-{spread[1] * scale:{spec}}]"
    return text


def fmt_quality(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.2f}%" if metric == "test_acc" else f"{v:.3f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table of cell rows (aggregated repetitions, or single runs). With a lost
    node (rows with ``kill``), time to target and final quality are the survivors', and the
    best quality and the behaviour (stops / continues / finished) follow."""
    head: tuple[str, ...] = (
        "workload", "layout", "rate", "method", "n", "step ms", "samples/s",
        "t->target s [min-max]", "steps->target", "final", "inter B/step (iface)",
        "(qcomm|formula)", "diff", "diff -hdr", "comm %")
    killed = any(r.get("kill") for r in rows)
    if killed:
        head = (*head[:7], "survivors t->target s [min-max]", "survivors steps->target",
                "survivors final", *head[10:],
                "best", "behaviour")
    lines = []
    notes: dict[int, str] = {}  # row -> status, printed after the row (it sizes no column)
    for r in rows:
        if r.get("status") != "ok":
            failed = r["status"].startswith("failed")
            n = f"0/{r.get('repeats', 1)}" if failed else "-"
            notes[len(lines)] = r["status"]
            lines.append((r.get("workload", "mnist1d"), r["layout"], r["rate"], r["method"], n,
                          *([""] * (len(head) - 5))))
            continue
        ref = r["inter_bytes_qcomm"] if r["inter_bytes_qcomm"] is not None else \
            r["inter_bytes_formula"]
        tag = {"qcomm": "q", "formula": "f"}.get(r["bytes_reference"] or "", "")
        spread = r.get("spread") or {}
        n = str(r.get("repeats_ok", 1))
        if r.get("repeats", 1) != r.get("repeats_ok", 1):
            n += f"/{r['repeats']}"
        lines.append((
            r.get("workload", "mnist1d"), r["layout"], r["rate"], r["method"], n,
            fmt_spread(r["step_median_s"], spread.get("step_median_s"), ".1f", 1e3),
            fmt(r["samples_per_s"], ".0f"),
            fmt_spread(r["time_to_target_s"], spread.get("time_to_target_s"), ".1f",
                       none="never"),
            fmt_spread(r.get("steps_to_target"), spread.get("steps_to_target"), ".0f",
                       none="never"),
            fmt_quality(r["final"], r.get("metric", "test_acc")),
            fmt_bytes(r["inter_bytes_iface"]),
            f"{fmt_bytes(ref)} {tag}".strip(), fmt(None if r["bytes_rel_diff"] is None
                                                   else 100 * r["bytes_rel_diff"], ".2f") + "%",
            fmt(None if r.get("payload_rel_diff") is None else 100 * r["payload_rel_diff"],
                ".2f") + "%",
            fmt(None if r["comm_fraction"] is None else 100 * r["comm_fraction"], ".0f"),
        ))
        if killed:
            lines[-1] = (*lines[-1], fmt_quality(r.get("best"), r.get("metric", "test_acc")),
                         r.get("behaviour") or "-")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    for i, line in enumerate(lines):
        if i in notes:
            out.append("  ".join(str(x).ljust(w) for x, w in zip(line[:5], widths, strict=False))
                       + "  " + notes[i])
        else:
            out.append("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))
    return "\n".join(out)


def _cell(r: dict[str, Any]) -> str:
    """A markdown row's first four cells, the cell's names: ``| workload | layout | rate |
    method |``."""
    return f"| {r.get('workload', 'mnist1d')} | {r['layout']} | {r['rate']} | {r['method']} |"


def _time_to_target(r: dict[str, Any]) -> str:
    """A markdown row's time to target: the median [min-max], ``never`` for none."""
    return fmt_spread(r["time_to_target_s"], (r.get("spread") or {}).get("time_to_target_s"),
                      ".1f", none="never")


def kill_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: what each method did when the node was lost (rows of one sweep with
    ``--kill-node``): behaviour, the survivors' time to target and final quality, the best
    quality their snapshots reached."""
    lines = ["| workload | layout | rate | method | behaviour | survivors' time to target s | "
             "survivors' final | best |", "|" + "---|" * 8]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"{_cell(r)} {r['status']} | - | - | - |")
            continue
        metric = r.get("metric", "test_acc")
        lines.append(f"{_cell(r)} {r.get('behaviour') or '-'} | {_time_to_target(r)} | "
                     f"{fmt_quality(r['final'], metric)} | {fmt_quality(r.get('best'), metric)} |")
    return "\n".join(lines)


def rejoin_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per cell, when the lost node took its first step again (after its loss, after
    its restart), how long its join took (the method's build, which announces it, takes the
    state and links, and the first step; for an elastic restart, from the node's torchrun
    entering the rendezvous), and the running nodes' step rate during the join over their rate
    before it and over their rate before the loss (min and median over the running ranks; an
    elastic restart has no rate before the join: its nodes were starting again), medians
    [min-max]."""
    lines = ["| workload | layout | rate | method | loss to first step s | restart to first "
             "step s | the join s | running rate during join / before it (min) | (median) | "
             "/ before the loss (min) | (median) | time to target s |", "|" + "---|" * 12]
    for r in rows:
        rj = r.get("rejoin")
        if r.get("status") != "ok" or not rj:
            continue
        cells = [_median_spread(rj.get(k), rj.get(f"{k}_spread")) for k in REJOIN_FIELDS]
        lines.append(f"{_cell(r)} " + " | ".join(cells) + f" | {_time_to_target(r)} |")
    return "\n".join(lines)


def _median_spread(median: float | None, lo_hi: list[float] | None) -> str:
    """``0.4 [0.35-0.45]``; no spread when the repetitions agree, ``-`` for no figure."""
    if median is None:
        return "-"
    return f"{median:.4g}" + (f" [{lo_hi[0]:.4g}-{lo_hi[1]:.4g}]"
                              if lo_hi and lo_hi[0] != lo_hi[1] else "")


def equal_steps_table(rows: Sequence[dict[str, Any]], key: str = "quality_at_steps") -> str:
    """Per cell, the quality (median over repetitions [min-max]) at equal steps of the fastest
    node (``key="quality_at_work"``: at equal mean steps of the nodes)."""
    keyed = [r for r in rows if r.get(key)]
    if not keyed:
        return ""
    marks = list(keyed[0][key])
    lines = ["| workload | layout | rate | method | " + " | ".join(
        f"at step {m}" for m in marks) + " |", "|---" * (4 + len(marks)) + "|"]
    for r in keyed:
        q, spread = r[key], r.get(f"{key}_spread") or {}
        cells = [_median_spread(q.get(m), spread.get(m)) for m in marks]
        lines.append(f"{_cell(r)} " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_tables(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table of every cell, the quality at equal steps; with a lost node, what each method
    did."""
    print()
    print(table(rows))
    steps = equal_steps_table(rows)
    if steps:
        print("\nquality at equal steps of the fastest node (median of the repetitions "
              "[min-max]):\n")
        print(steps)
    work = equal_steps_table(rows, "quality_at_work")
    if work:
        print("\nquality at equal work, the nodes' mean steps (median of the repetitions "
              "[min-max]):\n")
        print(work)
    if args.kill_node is not None:
        print(f"\nnode {args.kill_node} lost at {args.kill_at:g} of each run:\n")
        print(kill_table(rows))
    if args.join_at is not None:
        print(f"\nnode {args.kill_node} back at {args.join_at:g} of each run:\n")
        print(rejoin_table(rows))


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/sweep_tables.py is a library of the cluster benchmark "
        "(the tables a sweep prints), imported by compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
