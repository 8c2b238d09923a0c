"""bench/checkpoint_resume.py: saves one rank's checkpoint of the asked size once, then times
its loads (tiny here: 1 MB, one load)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_saves_once_and_times_the_loads(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "bench/checkpoint_resume.py"), "--mb", "1", "--repeat",
           "2", "--dir", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    line = first.stdout.strip().splitlines()[-1]
    match = re.search(r"files ([\d.]+) MB in .*: load ([\d.]+) s median \(loads: (.*)\)", line)
    assert match, line
    assert 0.99 < float(match[1]) < 1.01   # 1 MB of tensors, a little of pickle and record
    assert len(match[3].split(", ")) == 2
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank00000.json", "rank00000.pt"]
    stamp = (tmp_path / "rank00000.pt").stat().st_mtime_ns
    subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert (tmp_path / "rank00000.pt").stat().st_mtime_ns == stamp   # reused, not rewritten
