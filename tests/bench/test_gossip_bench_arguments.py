"""bench/gossip_progress.py and bench/gossip_transport.py refuse what they cannot measure (too
few timed steps or rounds to take a median of), naming the option, before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, args, message", [
    ("gossip_progress.py", ["--steps", "3"], "--steps must be > 3"),
    ("gossip_progress.py", ["--procs", "1"], "--procs >= 2"),
    ("gossip_transport.py", ["--rounds", "15"], "--rounds must be a multiple of 10"),
    ("gossip_transport.py", ["--rounds", "0"], "--rounds must be a multiple of 10"),
    ("gossip_transport.py", ["--nbytes", "0"], "--nbytes >= 1"),
])
def test_too_little_to_measure_is_refused_naming_the_option(script: str, args: list[str],
                                                            message: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
