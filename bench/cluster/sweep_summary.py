"""What a sweep leaves behind: the machine it ran on, the cells whose byte counts disagree or
whose runs failed, and ``summary.json`` with everything it found.

Imported by compare.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.cluster.sweep_plan import Sweep


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def problems(rows: Sequence[dict[str, Any]],
             args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(cells whose two byte counts disagree, cells with a failed run)."""
    # Judged where the second count is the method's own (qcomm's stats); formulas are payload
    # only, and PowerSGD's many small messages carry more framing than 5%
    # (bench/results/2026-11-30-cluster-sweeps.md).
    # Not under a lost node: no barrier closes the window, and the survivors stop apart.
    bad_bytes = [r for r in rows if r.get("status") == "ok" and r["bytes_reference"] == "qcomm"
                 and not r.get("kill")
                 and (r["bytes_rel_diff"] is None or r["bytes_rel_diff"] > args.agree)]
    failed = [r for r in rows if r.get("status", "").startswith("failed")
              or r.get("failed_repeats")]
    return bad_bytes, failed


def write_summary(sweep: Sweep, args: argparse.Namespace, env: dict[str, Any],
                  rows: Sequence[dict[str, Any]], checks: dict[str, list[dict]],
                  bad_bytes: Sequence[dict], failed: Sequence[dict]) -> Path:
    """Everything the sweep found, as ``summary.json`` in the output directory."""
    # The lost-node and timeout options only when given (a healthy sweep's summary as before).
    given = {k: v for k, v in vars(args).items()
             if not (k in ("kill_node", "kill_at", "join_at", "pg_timeout") and v is None)}
    summary = {"environment": env, "args": given, "data": sweep.data_info, "targets_quality":
               sweep.targets, "rows": rows, "targets": checks,
               "bytes_disagree": [r["method"] for r in bad_bytes],
               "failed": [f"{r.get('workload')} {r['layout']} {r['rate']} {r['method']}"
                          for r in failed]}
    path = sweep.outdir / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/sweep_summary.py is a library of the cluster benchmark "
        "(a sweep's summary.json and its problems), imported by compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
