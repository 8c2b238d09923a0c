"""bench/one_peer_processes.py refuses a member to kill that is not in the run, by name, before
it starts any process (it failed with an IndexError after starting them all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "one_peer_processes.py"


@pytest.mark.parametrize(("argv", "named"), [
    (["--members", "4"], "--kill must be a member, 0 to 3, got 5"),
    (["--members", "4", "--kill", "-1"], "--kill must be a member, 0 to 3, got -1"),
    (["--members", "1", "--kill", "0"], "--members must be >= 2, got 1"),
])
def test_a_member_outside_the_run_is_refused_by_name(argv: list[str], named: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr, proc.stderr
