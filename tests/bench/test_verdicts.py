"""bench/cluster/verdicts.py: time to several targets and quality at wall-clock budgets per
repetition, medians with spreads, and verdicts that call overlapping spreads a tie and a late
crossing a win without margin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cluster import verdicts as V

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cluster" / "verdicts.py"


def _curve(points: list[tuple[float, float]], metric: str = "test_acc") -> list[dict]:
    return [{"step": 10.0 * i, "time_s": t, metric: v} for i, (t, v) in enumerate(points)]


def test_crossing_is_the_first_snapshot_that_reaches_with_its_place_in_the_run() -> None:
    c = _curve([(0.0, 0.1), (1.0, 0.6), (2.0, 0.7), (4.0, 0.65)])
    assert V.crossing(c, 0.65, "test_acc", "max") == (2.0, 0.5)
    assert V.crossing(c, 0.8, "test_acc", "max") is None
    loss = _curve([(0.0, 3.0), (5.0, 1.95), (10.0, 1.85)], "val_loss")
    assert V.crossing(loss, 1.90, "val_loss", "min") == (10.0, 1.0)


def test_quality_at_a_budget_is_the_last_snapshot_taken_by_then() -> None:
    c = _curve([(0.0, 0.1), (1.0, 0.6), (2.0, 0.7)])
    assert V.quality_at(c, 1.5, "test_acc") == 0.6
    assert V.quality_at(c, 1.0, "test_acc") == 0.6  # taken exactly at the budget counts
    assert V.quality_at(c, 9.0, "test_acc") == 0.7  # the run ended before: its final model
    assert V.quality_at(_curve([(0.5, 0.1)]), 0.2, "test_acc") is None


def _s(values: list[float], lower: bool = True) -> V.Spread:
    spread = V.Spread.of(values, lower)
    assert spread is not None
    return spread


def test_spreads_apart_make_a_winner_and_overlapping_ones_a_tie() -> None:
    j = V.judge({"a": _s([2.0, 2.1, 2.4]), "b": _s([3.0, 3.5, 4.0]), "c": None})
    assert (j["winner"], j["runner"], j["apart"], j["ties"]) == ("a", "b", True, [])
    assert j["ratio"] == pytest.approx(3.5 / 2.1)
    j = V.judge({"a": _s([2.0, 2.1, 3.1]), "b": _s([3.0, 3.5, 4.0])})
    assert (j["winner"], j["apart"], j["ties"]) == ("a", False, ["b"])


def test_never_counts_as_slowest_and_a_method_that_never_reaches_cannot_win() -> None:
    inf = V.INF
    j = V.judge({"a": _s([inf, inf, 1.0]), "b": _s([5.0, 6.0, 7.0])})
    assert j["winner"] == "b" and j["ties"] == ["a"]  # a reached once, faster: not apart
    j = V.judge({"a": _s([inf, inf, inf]), "b": _s([5.0, 6.0, 7.0])})
    assert (j["winner"], j["runner"], j["apart"]) == ("b", None, True)
    assert V.judge({"a": _s([inf, inf])})["winner"] is None


def test_qualities_win_by_their_difference_either_way_round() -> None:
    acc = V.judge({"a": _s([0.70, 0.71, 0.72], lower=False),
                   "b": _s([0.60, 0.61, 0.62], lower=False)}, "quality")
    assert acc["winner"] == "a" and acc["ratio"] == pytest.approx(0.10) and acc["apart"]
    loss = V.judge({"a": _s([1.80, 1.81]), "b": _s([1.70, 1.75])}, "quality")
    assert loss["winner"] == "b" and loss["ratio"] == pytest.approx(0.08)


def test_one_run_per_method_has_no_spread_to_judge_by() -> None:
    j = V.judge({"a": _s([2.0]), "b": _s([3.0])})
    assert j["winner"] == "a" and not j["apart"] and not j["spread_known"]
    assert "no spread" in V.verdict_text(j, "time")


def test_a_crossing_in_the_last_tenth_has_no_margin() -> None:
    j = V.judge({"a": _s([2.0, 2.1]), "b": _s([3.0, 3.1])})
    assert "margin" not in V.verdict_text(j, "time", fraction=0.85)
    assert "no margin (crosses at 95% of its run)" in V.verdict_text(j, "time", fraction=0.95)


def _row(method: str, curves: list[list[dict]], finals: list[float]) -> dict:
    return {"method": method, "workload": "mnist1d", "layout": "4x1", "rate": "100mbit",
            "status": "ok", "metric": "test_acc", "goal": "max", "final": finals[0],
            "curve": curves[0], "per_repeat": [{"status": "ok", "curve": c, "final": f}
                                               for c, f in zip(curves, finals, strict=True)]}


GOALS = V.Goals(targets=(0.6, 0.7), budgets_s=(1.0, 3.0))


def _summary() -> dict:
    fast = [_curve([(0.0, 0.1), (1.0, 0.62 + d), (2.0, 0.72 + d)]) for d in (0.0, 0.01, 0.02)]
    # the slow method reaches 70% only at its very end: a win there has no margin
    slow = [_curve([(0.0, 0.1), (2.0, 0.55), (3.0, 0.61), (9.5 + d, 0.70), (10.0 + d, 0.71)])
            for d in (0.0, 0.1, 0.2)]
    return {"rows": [_row("fast", fast, [0.72, 0.73, 0.74]),
                     _row("slow", slow, [0.71, 0.71, 0.71])],
            "environment": {"cpu": "AMD EPYC", "cpus": 2, "loadavg_at_start": [1.0, 1.0, 1.0]}}


def test_a_cell_table_has_every_method_every_goal_and_the_verdicts() -> None:
    md, verdicts = V.cell_table(_summary()["rows"], GOALS)
    lines = md.splitlines()
    # the ceiling: the best median final (73%) less half a point
    assert lines[0] == ("| method | s to 60% | s to 70% | s to 72.5% (ceiling) | % at 1 s "
                        "| % at 3 s | final | best | end of the run |")
    assert lines[2] == ("| fast | 1.0 | 2.0 | 2.0 [2.0-never] | 63.0 [62.0-64.0] "
                        "| 73.0 [72.0-74.0] | 73.0 [72.0-74.0] | 73.0 [72.0-74.0] "
                        "| ends at its best |")
    assert lines[3].startswith("| slow | 3.0 | 9.6 [9.5-9.7] | never | 10.0 | 61.0 |")
    by_goal = {v["goal"]: v for v in verdicts}
    assert by_goal["time to 0.7"]["winner"] == "fast" and by_goal["time to 0.7"]["apart"]
    assert by_goal["time to 0.7"]["ratio"] == pytest.approx(9.6 / 2.0)
    assert by_goal["final"]["winner"] == "fast" and by_goal["final"]["apart"]
    assert by_goal["quality at 1 s"]["ratio"] == pytest.approx(63.0 - 10.0)
    assert by_goal["best"]["winner"] == "fast"


def test_a_run_that_peaks_and_declines_is_reported_as_such_and_sets_no_ceiling() -> None:
    # "sprint" is first to 70% and peaks at 80%, then ends at 76-77%; "steady" ends at 83%:
    # the ceiling is 82.5%, which only steady reaches, and sprint's decline is named
    sprint = [_curve([(0.0, 0.1), (1.0, 0.75), (2.0, 0.80 + d), (4.0, 0.78), (6.0, 0.76 + d)])
              for d in (0.0, 0.005, 0.01)]
    steady = [_curve([(0.0, 0.1), (2.0, 0.65), (3.0, 0.72), (5.0, 0.83 + d), (6.0, 0.83 + d)])
              for d in (0.0, 0.002, 0.004)]
    rows = [_row("sprint", sprint, [0.76, 0.765, 0.77]),
            _row("steady", steady, [0.83, 0.832, 0.834])]
    md, verdicts = V.cell_table(rows, GOALS)
    lines = md.splitlines()
    assert "s to 82.7% (ceiling)" in lines[0]
    assert lines[2].endswith("| 76.5 [76.0-77.0] | 80.5 [80.0-81.0] "
                             "| peaks, then declines by 4.0 |")
    assert lines[3].endswith("| ends at its best |")
    by_goal = {v["goal"]: v for v in verdicts}
    assert by_goal["time to 0.7"]["winner"] == "sprint"
    assert by_goal["time to 0.827"]["winner"] == "steady"   # only steady reaches the ceiling
    assert by_goal["final"]["winner"] == "steady" and by_goal["final"]["apart"]
    assert by_goal["best"]["winner"] == "steady"
    # a decline in one repetition of three is counted as such; within the margin it is none
    half = [sprint[0], steady[1], steady[2]]
    md, _ = V.cell_table([_row("mixed", half, [0.76, 0.83, 0.834])], GOALS)
    assert "peaks, then declines by" in md and "(1 of 3)" in md
    assert not V.declined(0.80, 0.796, "max") and V.declined(0.80, 0.794, "max")
    assert not V.declined(2.00, 2.019, "min") and V.declined(2.00, 2.021, "min")


def test_a_late_winner_is_marked_without_margin() -> None:
    rows = [r for r in _summary()["rows"] if r["method"] == "slow"]
    rows.append(_row("never", [_curve([(0.0, 0.1), (10.0, 0.5)])] * 3, [0.5] * 3))
    md, _ = V.cell_table(rows, GOALS)
    assert "slow 1.00x" not in md and "slow alone, spreads apart; no margin (crosses at 95%" in md


def test_the_command_writes_the_table_and_the_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_summary()))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--json",
                          str(tmp_path / "v.json")], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("### mnist1d, 4x1, 100mbit")
    assert "AMD EPYC, 2 CPUs" in out.stdout
    data = json.loads((tmp_path / "v.json").read_text())
    assert [v["goal"] for v in data["mnist1d 4x1 100mbit"]] == [
        "time to 0.6", "time to 0.65", "time to 0.72", "time to 0.725", "quality at 2 s",
        "quality at 4 s", "quality at 8 s", "final", "best"]


def test_older_summaries_fall_back_to_the_median_curve() -> None:
    row = _row("a", [_curve([(0.0, 0.1), (1.0, 0.7)])], [0.7])
    del row["per_repeat"][0]["curve"]
    assert V.repeat_curves(row) == [row["curve"]]


def test_qcomm_best_against_the_best_peer_is_judged_beside_the_cell_verdict() -> None:
    def run(t_cross: float) -> list[dict]:
        return [_curve([(0.0, 0.1), (t_cross + d, 0.72), (12.0, 0.73)]) for d in (0.0, 0.1, 0.2)]

    rows = [_row("assgd-2-a", run(4.0), [0.73] * 3), _row("qcomm-hook", run(2.0), [0.73] * 3),
            _row("localsgd-p8", run(3.0), [0.73] * 3), _row("ddp", run(6.0), [0.74] * 3)]
    md, verdicts = V.cell_table(rows, GOALS)
    line = next(x for x in md.splitlines() if x.startswith("| **qcomm vs the best peer**"))
    assert "qcomm-hook 1.48x, spreads apart" in line  # 3.1 / 2.1: the best of each side
    ours = [v for v in verdicts if v.get("scope") == "qcomm vs the best peer"]
    assert [v["goal"] for v in ours] == ["time to 0.6", "time to 0.7", "time to 0.735",
                                         "quality at 1 s", "quality at 3 s", "final", "best"]
    assert ours[0]["winner"] == "qcomm-hook" and ours[0]["runner"] == "localsgd-p8"
    assert ours[-1]["winner"] == "ddp"  # a peer ends higher: said so
    # a cell with no peer (or no qcomm method) has no such line
    md, _ = V.cell_table(rows[:2], GOALS)
    assert "best peer" not in md


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]", '{"cells": []}'])
def test_a_file_that_is_no_summary_is_refused_by_name(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "summary.json"
    if content is not None:
        path.write_text(content)
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "summary:" in r.stderr and "Traceback" not in r.stderr


def test_quality_at_equal_work_reads_the_nodes_mean_steps() -> None:
    # a wait-free run: its points carry the nodes' mean step, below the fastest node's
    curve = [{"step": s, "fastest_step": f, "time_s": t, "test_acc": q}
             for s, f, t, q in [(0.0, 0, 0.0, 0.1), (7.5, 10, 1.0, 0.4), (10.25, 14, 1.5, 0.5)]]
    assert V.quality_at_work(curve, 10, "test_acc") == 0.5     # not the point at fastest 10
    assert V.quality_at_work(curve, 11, "test_acc") is None    # the run stopped short
    lockstep = [_curve([(0.0, 0.1), (1.0, 0.45)])] * 2          # steps 0 and 10
    waitfree = [curve, [{**p, "test_acc": p["test_acc"] + 0.02} for p in curve]]
    rows = [{**_row("lockstep", lockstep, [0.45, 0.45]), "quality_at_steps": {"10": 0.45}},
            {**_row("wait-free", waitfree, [0.5, 0.52]),
             "quality_at_steps": {"10": 0.4, "20": None}}]
    md, _ = V.cell_table(rows, GOALS)
    lines = md.splitlines()
    at = lines.index("| method | at 10 steps each | at 20 steps each |")
    assert lines[at + 2] == "| lockstep | 45.0 | - |"
    assert lines[at + 3] == "| wait-free | 51.0 [50.0-52.0] | - |"


def test_a_summary_without_step_marks_has_no_equal_work_table() -> None:
    md, _ = V.cell_table(_summary()["rows"], GOALS)
    assert "steps each" not in md


def test_targets_and_budgets_of_another_run_replace_the_workloads(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_summary()))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--targets", "0.6,0.7",
                          "--budgets", "1,3", "--json", str(tmp_path / "v.json")],
                         capture_output=True, text=True, check=True)
    assert ("| method | s to 60% | s to 70% | s to 72.5% (ceiling) | % at 1 s | % at 3 s "
            "| final | best | end of the run |") in out.stdout
    data = json.loads((tmp_path / "v.json").read_text())
    assert [v["goal"] for v in data["mnist1d 4x1 100mbit"]][:5] == [
        "time to 0.6", "time to 0.7", "time to 0.725", "quality at 1 s", "quality at 3 s"]


@pytest.mark.parametrize(("extra", "words"), [
    (["--targets", "0.6"], "--targets and --budgets go together"),
    (["--budgets", "1"], "--targets and --budgets go together"),
    (["--targets", "0.6,x", "--budgets", "1"], "--targets / --budgets"),
    (["--targets", "0.6", "--budgets", "0"], "--budgets must be seconds > 0"),
])
def test_bad_targets_or_budgets_are_refused_by_name(tmp_path: Path, extra, words) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_summary()))
    r = subprocess.run([sys.executable, str(SCRIPT), str(path), *extra], capture_output=True,
                       text=True)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
