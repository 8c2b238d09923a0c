"""The cluster benchmark's lost node that comes back (``--join-at``), without a cluster: the
checks of its flags, what a join cost from the ranks' step times, and how a run's row reads
when the node came back or its join failed. The launch itself runs as root on the emulated
cluster (bench/cluster_smoke.sh)."""

from __future__ import annotations

import types

import pytest
import torch

from bench.cluster import compare as C
from bench.cluster import rejoining as J
from bench.cluster import workload as WL

CONT = "assgd-2-h16f4-g80-m9-o5-n-ddp-cont"


@pytest.mark.parametrize(("method", "kill_at", "join_at", "seconds", "match"), [
    (CONT, None, 0.5, True, "needs --kill-node and --kill-at"),
    (CONT, 0.3, 0.2, True, "above --kill-at"),
    (CONT, 0.3, 1.0, True, "below 1"),
    ("ddp-powersgd", 0.3, 0.5, True, "has no way back for a lost node"),
    ("torchft-hsdp", 0.3, 0.5, True, "has no way back for a lost node"),
    ("assgd-2-h16f4-wf", 0.3, 0.5, True, "end in -cont"),
    (CONT, 0.3, 0.5, False, "needs --time-budget in seconds"),
])
def test_bad_join_settings_are_named(method, kill_at, join_at, seconds, match) -> None:
    assert match in J.join_problem(method, kill_at, join_at, seconds)


@pytest.mark.parametrize("method", [CONT, "ddp", "localsgd", "localsgd-p32", "torchft-diloco"])
def test_good_join_settings_pass(method) -> None:
    assert J.join_problem(method, 0.2, 0.45, True) is None


def test_workload_sends_the_elastic_peers_to_their_own_worker(capsys) -> None:
    with pytest.raises(SystemExit):
        WL.parse_args(["--method", "ddp", "--data", "d.npz", "--out", "o.json",
                       "--time-budget", "30", "--kill-node", "1", "--kill-at", "0.2",
                       "--join-at", "0.5"])
    assert "recovery.py" in capsys.readouterr().err


def test_workload_refuses_join_at_without_a_budget(capsys) -> None:
    with pytest.raises(SystemExit):
        WL.parse_args(["--method", CONT, "--data", "d.npz", "--out", "o.json",
                       "--kill-node", "1", "--kill-at", "0.2", "--join-at", "0.5"])
    assert "needs --time-budget in seconds" in capsys.readouterr().err


def _ranks(seat: float = 100.0) -> list[dict]:
    """Node 1 came back: its join (the method's build and first step) from ``seat`` to 2 s
    later. Node 0 steps 10/s before and 8/s from then; node 2 steps 10/s throughout."""
    before = [seat - 5 + i / 10 for i in range(50)]
    during = [seat + i / 8 for i in range(8 * 6)]
    steady = [seat - 5 + i / 10 for i in range(110)]
    joiner = {"rank": 1, "node": 1, "step_ends": [seat + 2 + i / 10 for i in range(20)],
              "timeline": {"process_start": seat - 1.5, "window_opened": seat - 20,
                           "seat_taken": seat - 0.5, "build_start": seat,
                           "first_step_start": seat + 1.9, "first_step_end": seat + 2}}
    return [{"rank": 0, "node": 0, "step_ends": before + during, "timeline": None}, joiner,
            {"rank": 2, "node": 2, "step_ends": steady, "timeline": None}]


def test_join_summary_measures_the_running_nodes_rate_and_the_joiners_timeline() -> None:
    s = J.join_summary(_ranks(), kill_time=90.0, join_node=1)
    assert s["restart_to_first_step_s"] == pytest.approx(3.5)
    assert s["restart_to_seat_s"] == pytest.approx(1.0)
    assert s["seat_to_first_step_s"] == pytest.approx(2.5)
    assert s["join_s"] == pytest.approx(2.0)
    assert s["kill_to_first_step_s"] == pytest.approx(12.0)
    # The join's window: the build's start until 1 s after the first step's end (3 s).
    assert s["join_window_s"] == pytest.approx(3.0)
    assert sorted(s["running_rate_vs_before_join"]) == pytest.approx([0.8, 1.0], abs=0.04)
    assert s["running_rate_vs_before_join_min"] == pytest.approx(0.8, abs=0.04)


def test_a_joiner_that_never_stepped_has_no_summary() -> None:
    ranks = _ranks()
    ranks[1]["timeline"]["first_step_end"] = None
    assert J.join_summary(ranks, kill_time=90.0, join_node=1) is None


def test_the_curve_skips_the_marks_before_a_node_came_back() -> None:
    """Node 1 has no snapshot at marks 0 and 1: those marks average node 0 alone."""
    class Work:
        info = types.SimpleNamespace(metric="test_acc")

        def make_model(self):
            return torch.nn.Linear(1, 1, bias=False)

        def evaluate(self, model):
            return float(model.weight.detach())

    def snap(step, t, w):
        return (step, t, {"weight": torch.tensor([[w]])})

    node0 = [snap(0, 0.0, 1.0), snap(10, 1.0, 2.0), snap(20, 2.0, 3.0)]
    node1 = [None, None, snap(5, 2.1, 5.0)]
    curve = WL.evaluate_curve(Work(), [node0, node1])
    assert [p["test_acc"] for p in curve] == [1.0, 2.0, 4.0]
    assert curve[2]["time_s"] == pytest.approx(2.1)


def _result(joiner_error: dict | None, first_step: float | None) -> dict:
    ranks = [{"rank": r, "node": r, "status": "finished", "live_nodes": 4} for r in (0, 2, 3)]
    ranks.append({"rank": 1, "node": 1, "status": "stopped" if joiner_error else "finished",
                  "error": joiner_error})
    curve = [{"step": 0, "time_s": 0.0, "test_acc": 0.1},
             {"step": 100, "time_s": 5.0, "test_acc": 0.6},
             {"step": 300, "time_s": 20.0, "test_acc": 0.75}]
    return {"kill": {"node": 1, "happened": True, "time_s": 6.0, "killed_at_s": 6.0},
            "ranks": ranks, "curve": curve, "metric": {"name": "test_acc", "goal": "max"},
            "nodes": [{"node": n, "killed": False} for n in range(4)], "final_test_acc": 0.75,
            "rejoin": {"kill_to_first_step_s": first_step}}


def test_a_failed_join_does_not_make_the_run_one_that_stops() -> None:
    result = _result({"type": "TimeoutError", "message": "no state", "where": "step",
                      "step": 1}, None)
    row = C.kill_summary(result, 0.7)
    row.update(C.rejoin_summary(result, row, 0.7))
    assert row["outcome"] == "continues"
    assert row["behaviour"] == "continues; node 1 did not come back (its join: TimeoutError)"
    assert row["time_to_target_s"] == pytest.approx(20.0)   # the whole curve counts


def test_a_node_that_came_back_says_when() -> None:
    result = _result(None, 14.4)
    row = C.kill_summary(result, 0.7)
    row.update(C.rejoin_summary(result, row, 0.7))
    assert row["behaviour"] == "continues; node 1 back 14.4 s after its loss"
    assert row["rejoin"]["kill_to_first_step_s"] == 14.4


def test_a_running_node_that_stops_still_stops_the_run() -> None:
    result = _result(None, 14.4)
    result["ranks"][0].update(status="stopped", error={
        "type": "PeerTimeoutError", "message": "x", "where": "step", "step": 7})
    row = C.kill_summary(result, 0.7)
    row.update(C.rejoin_summary(result, row, 0.7))
    assert row["outcome"] == "stops"
