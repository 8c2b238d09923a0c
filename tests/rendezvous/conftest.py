"""The rendezvous of the seat tests: ``python -m qcomm.rendezvous`` as a process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qcomm.testing.multiprocess import free_port
from tests.rendezvous.test_launch import ENV


@pytest.fixture
def rendezvous():
    """Start ``python -m qcomm.rendezvous`` for a job of n nodes; yields its starter."""
    started: list[subprocess.Popen] = []

    def start(nodes: int, max_nodes: int | None = None) -> str:
        port = free_port()
        grow = [] if max_nodes is None else ["--max-nodes", str(max_nodes)]
        p = subprocess.Popen([sys.executable, "-m", "qcomm.rendezvous", "--host", "127.0.0.1",
                              "--port", str(port), "--nodes", str(nodes), *grow], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(p)
        assert "listening" in p.stdout.readline()
        return f"127.0.0.1:{port}"

    yield start
    for p in started:
        p.terminate()
        p.wait(timeout=10)
