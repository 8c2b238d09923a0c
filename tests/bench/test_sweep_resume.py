"""compare.py --resume: a sweep cut short is taken up with its kept runs read, not run again,
and only with the first invocation's settings. No root, no namespaces, no processes."""

from __future__ import annotations

import json

import pytest

from bench.cluster import compare as C
from bench.cluster import sweep_resume as R
from bench.cluster import training as T
from bench.cluster.sweep_plan import Sweep
from tests.bench.test_cluster_unit import _result

FIRST = ["--workload", "charlm", "--layouts", "2x2", "--rates", "100mbit", "--methods",
         "adamw-slow-link,localsgd-p8", "--steps", "1200", "--lr-schedule", "cosine",
         "--time-budget", "fastest", "--equal-cpu"]


def _args(tmp_path, *extra):
    return C.parse_args([*FIRST, "--out", str(tmp_path), *extra])


def _defaults(tmp_path):
    return C.parse_args(["--out", str(tmp_path)])


def test_the_same_settings_resume(tmp_path):
    R.record_args(_args(tmp_path), tmp_path)
    again = _args(tmp_path, "--resume", "--timeout", "1800", "--repeats", "5", "--no-plots")
    assert R.resume_problem(again, _defaults(tmp_path), tmp_path) is None


def test_another_setting_is_refused_and_named(tmp_path):
    R.record_args(_args(tmp_path), tmp_path)
    other = C.parse_args([*FIRST[:-5], "--steps", "600", "--lr-schedule", "cosine",
                          "--time-budget", "fastest", "--equal-cpu", "--out", str(tmp_path),
                          "--resume"])
    problem = R.resume_problem(other, _defaults(tmp_path), tmp_path)
    assert problem is not None
    assert "--steps 1200 then, 600 now" in problem and "new --out" in problem


def test_a_finished_sweeps_summary_is_read_and_a_key_it_lacks_is_its_default(tmp_path):
    """An older summary records no --links: the sweep ran with the default (world)."""
    given = {k: v for k, v in vars(_args(tmp_path)).items() if k not in ("links", "resume")}
    (tmp_path / "summary.json").write_text(json.dumps({"args": given}, default=str))
    assert R.resume_problem(_args(tmp_path, "--resume"), _defaults(tmp_path), tmp_path) is None
    sockets = _args(tmp_path, "--resume", "--links", "sockets")
    assert "--links 'world' then, 'sockets' now" in R.resume_problem(
        sockets, _defaults(tmp_path), tmp_path)


def test_nothing_to_resume_is_named(tmp_path):
    problem = R.resume_problem(_args(tmp_path, "--resume"), _defaults(tmp_path), tmp_path)
    assert problem is not None and "holds no sweep to take up" in problem


def test_resume_needs_out():
    with pytest.raises(SystemExit):
        C.parse_args([*FIRST, "--resume"])


def _sweep(tmp_path):
    sweep = Sweep(["mnist1d"], [T.Layout(2, 2)], ["100mbit"], ["ddp"], tmp_path)
    sweep.data["mnist1d"] = tmp_path / "mnist1d.npz"
    sweep.targets["mnist1d"] = 0.7
    (tmp_path / "runs").mkdir()
    return sweep


def test_a_kept_run_is_read_and_not_run_again(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path)
    kept = _result(acc=0.81)
    (tmp_path / "runs" / "mnist1d_2x2_100mbit_ddp_r1.json").write_text(json.dumps(kept))

    def no_run(*a, **k):
        raise AssertionError("a kept run was run again")

    monkeypatch.setattr(C, "run_one", no_run)
    args = _args(tmp_path, "--resume")
    row = C.run_cell(sweep, args, "c0", T.Layout(2, 2), ("mnist1d", "2x2", "100mbit", "ddp"), 0)
    assert row["final"] == pytest.approx(0.81) and row["rate"] == "100mbit"


def _run_writing(acc: float, ran: list[str]):
    """A stand-in for run_one: the run's JSON written with final accuracy ``acc``, its name
    noted in ``ran``."""

    def fake_run(cluster, layout, cmd, timeout, out_json, *rest):
        ran.append(out_json.name)
        out_json.write_text(json.dumps(_result(acc=acc)))
        return 0, ""

    return fake_run


def test_a_run_without_its_json_runs_again(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path)
    ran: list[str] = []
    monkeypatch.setattr(C, "run_one", _run_writing(0.77, ran))
    row = C.run_cell(sweep, _args(tmp_path, "--resume"), "c0", T.Layout(2, 2),
                     ("mnist1d", "2x2", "100mbit", "ddp"), 1)
    assert ran == ["mnist1d_2x2_100mbit_ddp_r2.json"]
    assert row["final"] == pytest.approx(0.77)


def test_without_resume_a_kept_json_is_run_again(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path)
    (tmp_path / "runs" / "mnist1d_2x2_100mbit_ddp_r1.json").write_text(json.dumps(_result()))
    ran: list[str] = []
    monkeypatch.setattr(C, "run_one", _run_writing(0.75, ran))
    row = C.run_cell(sweep, _args(tmp_path), "c0", T.Layout(2, 2),
                     ("mnist1d", "2x2", "100mbit", "ddp"), 0)
    assert ran and row["final"] == pytest.approx(0.75)
