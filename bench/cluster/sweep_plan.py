"""What one invocation of the sweep driver (compare.py) sweeps over: :class:`Sweep`, and the
name of one cell of its table (:data:`Cell`). Kept apart so that the modules that write the
sweep's report (sweep_summary.py) take it without importing the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import training as T

__all__ = ["Cell", "Sweep"]


@dataclass
class Sweep:
    """What one invocation sweeps over, where its files go, and each workload's data file and
    target (filled in by :func:`make_data`)."""

    workloads: list[str]
    layouts: list[T.Layout]
    rates: list[str]
    names: list[str]
    outdir: Path
    data: dict[str, Path] = field(default_factory=dict)
    data_info: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, float] = field(default_factory=dict)

    @property
    def combos(self) -> list[tuple[T.Layout, str]]:
        """The (layout, rate) pairs, one cluster each."""
        return [(lay, rate) for lay in self.layouts for rate in self.rates]


# One cell of the table: (workload, layout tag, rate, method).
Cell = tuple[str, str, str, str]


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/sweep_plan.py is a library of the cluster benchmark "
        "(what a sweep covers), imported by compare.py and sweep_summary.py; "
        "it runs nothing. See bench/cluster/README.md."
    )
