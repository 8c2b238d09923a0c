"""Fast checks of ``bench/gossip_scaling.py``: the all-reduce byte formulas against numbers
worked by hand, gossip bytes per round that do not grow with N on a ring, the exponential graph
no slower than the ring, the early-stop projection, and the script's table and JSON."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

from qcomm.compress import QuantSpec, packed_nbytes

REPO = Path(__file__).resolve().parents[2]


def _load_bench():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module("bench.gossip_scaling")


gs = _load_bench()


def test_allreduce_bytes_by_hand() -> None:
    # N = 2: each phase sends one half: 2 x 500 floats x 4 B.
    assert gs.allreduce_bytes(2, 1000) == 4000
    # N = 8, 4096 floats: 2 phases x 7 chunks x 512 floats x 4 B = 28672.
    assert gs.allreduce_bytes(8, 4096) == 28672
    assert gs.allreduce_bytes(1, 4096) == 0


def test_allgather_bytes_by_hand() -> None:
    # 4096 4-bit codes = 2048 B, plus 32 blocks x one float32 scale = 128 B; 7 peers.
    assert packed_nbytes(4096, QuantSpec(4, 128, "stochastic")) == 2176
    assert gs.allgather_bytes(8, 4096) == 7 * 2176


def test_ring_bytes_per_round_do_not_grow_with_n() -> None:
    runs = {n: gs.run_to_tol("lock-step", n, "ring", 512, tol=1e-9, max_rounds=3)
            for n in (8, 16)}
    per_round = {n: r["gossip_bytes_per_round"] for n, r in runs.items()}
    assert runs[8]["rounds_run"] == runs[16]["rounds_run"] == 3
    assert per_round[8] == per_round[16]
    # two neighbours, one 4-bit payload (and a small header) each per round
    assert 2 * packed_nbytes(512, gs.SPEC) <= per_round[8] < 2 * (packed_nbytes(512, gs.SPEC) + 64)


def test_exponential_needs_no_more_rounds_than_ring_at_16() -> None:
    # A loose target keeps the ring's run short; the ordering is the claim, not the count.
    ring = gs.run_to_tol("lock-step", 16, "ring", 512, tol=0.1, max_rounds=400)
    expo = gs.run_to_tol("lock-step", 16, "exponential", 512, tol=0.1, max_rounds=400)
    assert ring["outcome"] == expo["outcome"] == "reached"
    assert expo["rounds"] <= ring["rounds"]


def test_one_peer_graph_sends_half_the_ring_and_beats_it_at_16() -> None:
    ring = gs.run_to_tol("lock-step", 16, "ring", 512, tol=0.1, max_rounds=400)
    one = gs.run_to_tol("lock-step", 16, "one-peer-exp", 512, tol=0.1, max_rounds=400)
    assert one["outcome"] == "reached" and one["rounds"] < ring["rounds"]
    # one message per round against the ring's two, the same message size
    assert one["gossip_bytes_per_round"] * 2 == ring["gossip_bytes_per_round"]
    assert gs.graph_shape("one-peer-exp", 16) == (1, pytest.approx(1.0))  # exact in 4 rounds
    degree, gap = gs.graph_shape("one-peer-exp", 12)  # not exact: a gap between 0 and 1
    assert degree == 1 and 0 < gap < 1
    assert gs.graph_shape("ring", 8)[0] == 2


def test_projection_of_a_geometric_decay_is_exact() -> None:
    rate = 0.01
    log_d = [-rate * r for r in range(gs.WINDOW + 10)]
    target = math.log(1e-3)
    assert gs.projected_rounds(log_d[: gs.WINDOW], target) is None  # too few rounds yet
    assert gs.projected_rounds(log_d, target) == pytest.approx(-target / rate)
    assert gs.projected_rounds([0.0] * (gs.WINDOW + 1), target) == math.inf


def test_script_prints_one_table_and_writes_rows(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    argv = ["--nodes", "4", "--graphs", "ring", "--numel", "256", "--json", str(out)]
    assert gs.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("Simulation in one process (no network, no time")
    assert "--nodes 4 --graphs ring --numel 256" in text
    rows = json.loads(out.read_text())
    assert [(r["n"], r["graph"], r["outcome"]) for r in rows] == [(4, "ring", "reached")]
    assert rows[0]["gossip_bytes_to_tol"] == rows[0]["rounds"] * rows[0]["gossip_bytes_per_round"]
    assert text.count("\n| lock-step | 4 | ring |") == 1


def test_help_exits_zero(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        gs.main(["--help"])
    assert e.value.code == 0
    assert "--max-rounds" in capsys.readouterr().out
