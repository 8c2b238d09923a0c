"""What a cluster run writes: one rank's numbers, the command line as recorded, the run's JSON
(the same head whichever way the run ended), and JSON files written whole (a reader sees the
whole file or none).

Imported by workload.py and recovery.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # types only: the modules that import this one hold them
    from bench.cluster.training import Layout


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON to ``path``, atomically (a reader sees the whole file or none)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def rank_record(rank: int, node: int, local_rank: int, steps: int, step_times: list[float],
                fwd_bwd: list[float], opt_times: list[float], base_times: list[float],
                t_loop: float, t_window: float, counters: tuple | None, retrans: tuple | None,
                stats: tuple | None) -> dict[str, Any]:
    """One rank's numbers for the JSON. ``counters``, ``retrans`` and ``stats`` are the
    (window opened, window closed) readings, or None where this rank reads none. A rank that
    stopped before its first timed step has no step times (those fields are None)."""
    med = _median(step_times)
    return {
        "rank": rank, "node": node, "local_rank": local_rank, "steps": steps,
        "step_median_s": med,
        "step_mean_s": statistics.fmean(step_times) if step_times else None,
        # Stalls: the longest step, and when the long ones (over 10x the median) happened.
        "step_max_s": max(step_times) if step_times else None,
        "long_steps": [(i, round(t, 4)) for i, t in enumerate(step_times)
                       if t > 10 * med][:50] if step_times else [],
        "fwd_bwd_median_s": _median(fwd_bwd),
        "opt_step_median_s": _median(opt_times),
        "baseline_median_s": _median(base_times),
        "loop_s": t_loop, "window_s": t_window,
        "iface_tx_bytes": None if counters is None else counters[1][0] - counters[0][0],
        "iface_rx_bytes": None if counters is None else counters[1][1] - counters[0][1],
        "iface_tx_packets": None if counters is None else counters[1][2] - counters[0][2],
        "tcp_retrans_segs": None if retrans is None else retrans[1] - retrans[0],
        "qcomm_bytes": None if stats is None else
        {k: stats[1][k] - stats[0][k] for k in stats[1]},
    }


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The command line as the JSON records it (the kill options only when given)."""
    return {k: v for k, v in vars(args).items()
            if k != "out" and not (k in ("kill_node", "kill_at", "join_at") and v is None)}



def run_result(args: argparse.Namespace, work: Any, layout: Layout, model: tuple[int, list], *,
               final: float | None, curve: list[dict[str, float]], ranks: list[dict],
               notes: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The head of a run's JSON, the same for every end of a run (healthy, a lost node, a
    peer's own recovery), which adds its own fields after it.

    Args:
        args (argparse.Namespace): the worker's command line.
        work: the loaded workload (its metric, model and data settings).
        layout (Layout): the run's nodes and processes per node.
        model (tuple[int, list]): the parameters' count and their shapes.
        final (float | None): the final quality; curve: the evaluated snapshots; ranks: every
            rank's record, by rank; notes: the method's notes.
        config (dict[str, Any] | None): the command line as recorded; None: :func:`run_config`.
    """
    metric = work.info.metric
    numel, shapes = model
    return {
        "method": args.method,
        "workload": args.workload,
        "metric": {"name": metric, "goal": work.info.goal},
        "layout": {"nodes": layout.nodes, "procs": layout.procs, "world": layout.world},
        "model": {**work.model_config, "params": numel, "shapes": shapes},
        "data": work.data_config,
        "config": run_config(args) if config is None else config,
        f"final_{metric}": final,
        "curve": curve,
        "ranks": ranks,
        "notes": notes,
    }

if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/run_record.py is a library of the cluster benchmark "
        "(what a run writes), imported by workload.py and recovery.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
