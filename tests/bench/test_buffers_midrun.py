"""bench/buffers_midrun.py, tiny (2 nodes, 20 steps): each node's snapshot evaluated with its
own BatchNorm statistics, the nodes' mean ones and fully averaged, in one table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prints_the_three_ways_at_each_mark() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench/buffers_midrun.py"), "--nodes", "2",
                          "--steps", "20", "--every", "10", "--seeds", "1",
                          "--gossip", "every-step"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^\| (\d+) \| ([\d.]+)% \| ([\d.]+)% \| ([\d.]+)% \| ([+-][\d.]+) \|$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == [10, 20], out
    for _, own, mean_buffers, _, gap in rows:
        # the gap is theirs: each percentage is printed to 0.1 (off by up to 0.05 each), the
        # gap to 0.01 (off by up to 0.005)
        assert abs(float(own) - float(mean_buffers) - float(gap)) <= 0.105 + 1e-9
    assert "largest |own - mean buffers|" in out
