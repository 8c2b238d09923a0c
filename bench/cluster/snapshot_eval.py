"""The snapshots of a cluster run evaluated into its curve: at each mark, the average of the
nodes' parameters, timed at the latest of the nodes' snapshot times.

Imported by workload.py and recovery.py.
"""

from __future__ import annotations

import statistics

import torch


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the nodes' state dicts (floating tensors; others: node 0's)."""
    out = {}
    for key, first in states[0].items():
        if first.is_floating_point():
            out[key] = torch.stack([st[key] for st in states]).mean(dim=0)
        else:
            out[key] = first
    return out


# (step, seconds since the window opened, parameters)
Snapshot = tuple[int, float, dict[str, torch.Tensor]]


def evaluate_curve(work, per_node: list[list[Snapshot | None]]) -> list[dict[str, float]]:
    """The snapshots of several nodes -> the curve: at each mark, the average of the nodes'
    parameters evaluated, timed at the latest of the nodes' snapshot times."""
    evaluator = work.make_model()
    metric = work.info.metric
    curve = []
    for i in range(max(len(snaps) for snaps in per_node)):
        # A node that stopped before this mark (--max-steps) counts with its last snapshot; a
        # node that came back (--join-at) has None at the marks before its return.
        points = [snaps[min(i, len(snaps) - 1)] for snaps in per_node]
        points = [p for p in points if p is not None]
        if not points:
            continue
        evaluator.load_state_dict(average_states([st for _, _, st in points]))
        curve.append({"step": statistics.fmean(p[0] for p in points),
                      "fastest_step": max(p[0] for p in points),
                      "time_s": max(p[1] for p in points),
                      metric: work.evaluate(evaluator)})
    return curve


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/snapshot_eval.py is a library of the cluster benchmark "
        "(the snapshots evaluated into the curve), imported by workload.py and recovery.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
