"""bench/api_overhead.py: times every call of its table with the kernels replaced by nothing,
for this checkout or another one (tiny loops here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CALLS = ("quantize", "quantize non_blocking", "quantize in place non_blocking",
         "dequant_accumulate", "dequant_accumulate weights non_blocking")


@pytest.mark.parametrize("other", [False, True])
def test_times_every_call_of_the_api(other: bool) -> None:
    cmd = [sys.executable, str(REPO / "bench/api_overhead.py"), "--numel", "300", "--calls",
           "5", "--loops", "2"] + (["--qcomm", str(REPO)] if other else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"# qcomm from {REPO}" in out
    for name in CALLS:
        row = re.search(rf"^{re.escape(name)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", out, re.M)
        assert row, out
        median, fastest, slowest = (float(v) for v in row.groups())
        assert 0 < fastest <= median <= slowest


def test_bad_counts_are_named() -> None:
    run = subprocess.run([sys.executable, str(REPO / "bench/api_overhead.py"), "--calls", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--numel, --calls and --loops must be >= 1, got 4096, 0 and 7" in run.stderr
