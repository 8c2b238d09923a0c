"""What a cluster run writes: one rank's numbers, the command line as recorded, and JSON files
written whole (a reader sees the whole file or none).

Imported by workload.py and recovery.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any


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


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/run_record.py is a library of the cluster benchmark "
        "(what a run writes), imported by workload.py and recovery.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
