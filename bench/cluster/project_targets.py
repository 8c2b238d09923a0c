"""The project's targets for its own method, judged on one (workload, layout, rate) group of a
sweep's rows: its speedup in time to target over ddp, being faster than every peer, its final
quality beside ddp's and its inter-node bytes against ddp's.

Pure Python; imported by compare.py.
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

# The project's targets for its method (measured side by side with ddp and the peers).
TARGET_SPEEDUP = 4.95


TARGET_ACC_POINTS = 1.0


TARGET_BYTES_RATIO = 1 / 7


# The qcomm method the targets are about, per workload.
SUBJECT = {"mnist1d": "assgd-4", "mnist1d-bn": "assgd-4", "charlm": "qcomm-hier-4"}


def check_targets(rows: Sequence[dict[str, Any]], subject: str = "assgd-4") -> list[dict[str, Any]]:
    """The targets for the qcomm method ``subject`` in one (workload, layout, rate) group of
    rows: each with ``name``, ``ok`` (True/False, None when it cannot be judged), ``value`` and
    ``need``. Peers are the torch and torchft methods. The quality target (within 1 point of
    ddp's accuracy) is for accuracy; for a loss the difference is reported, unjudged."""
    by = {r["method"]: r for r in rows if r.get("status") == "ok"}
    a, d = by.get(subject), by.get("ddp")
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, value: Any, need: str) -> None:
        out.append({"name": name, "ok": ok, "value": value, "need": need})

    if a is None or d is None:
        add(f"{subject} vs ddp", None, None, f"needs ok runs of both {subject} and ddp")
        return out
    ta, td = a["time_to_target_s"], d["time_to_target_s"]
    if ta is None or td is None:
        add("time-to-target speedup over ddp", None if td is None else False,
            None, f">= {TARGET_SPEEDUP}x (a method did not reach the target)")
    else:
        add("time-to-target speedup over ddp", td / ta >= TARGET_SPEEDUP, td / ta,
            f">= {TARGET_SPEEDUP}x")
    peers = [r for r in by.values() if M.METHODS[r["method"]].family in ("torch", "torchft")]
    for p in peers:
        if p["method"] == "ddp":
            continue
        tp = p["time_to_target_s"]
        ok = None if ta is None else (tp is None or ta < tp)
        add(f"faster than {p['method']}", ok, None if (ta is None or tp is None) else tp / ta,
            "> 1x")
    if a.get("goal", "max") == "max":
        diff_points = 100.0 * (a["final"] - d["final"])
        add("final accuracy vs ddp (points)", diff_points >= -TARGET_ACC_POINTS, diff_points,
            f">= -{TARGET_ACC_POINTS}")
    else:
        add(f"final {a['metric']} vs ddp (difference)", None, a["final"] - d["final"],
            "reported (no target for a loss)")
    ba, bd = a["inter_bytes_iface"], d["inter_bytes_iface"]
    if ba is not None and bd:
        add("inter-node bytes/step vs ddp", ba / bd <= TARGET_BYTES_RATIO, ba / bd,
            f"<= 1/7 = {TARGET_BYTES_RATIO:.4f}")
    return out


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/project_targets.py is a library of the cluster benchmark "
        "(the targets for qcomm's method against ddp and the peers), imported by "
        "compare.py; it runs nothing. "
        "See bench/cluster/README.md."
    )
