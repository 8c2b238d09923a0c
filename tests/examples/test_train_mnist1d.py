"""examples/train_mnist1d.py, the README's demo: its report's arithmetic, and one tiny run end to
end whose printed projection is checked against its printed measurements.

Checked: a projected link time is bytes / rate and a projected run the measured run plus the
run's bytes / rate; the busiest node's bytes are what a link carries; the crossover rate is where
both projections meet, with the method of fewer bytes first below it; the verdict names, at
each rate, the method whose projected run is shorter; ``--emulated-link`` refuses to start
without root, saying why. End to end (4 processes, one epoch of a small model): the printed
per-step bytes and step times, train seconds and steps give the printed projection, and the
output ends with the verdict, whose winners match the printed projection.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_mnist1d.py"
sys.path.insert(0, str(EXAMPLE.parent))

import train_mnist1d as demo  # noqa: E402

pytest.importorskip("mnist1d")  # the demo extra; the test extra's suite installs it via bench

MBIT, GBIT = 1e6, 1e9


def _runs(q_seconds: float, s_seconds: float) -> tuple[demo.Run, demo.Run]:
    """A qcomm run that computes slower but sends 7.5x fewer bytes, as on a CPU."""
    return (demo.Run("ASSGD", 95.0, 1000, q_seconds, 76_000_000),
            demo.Run("synchronous fp32 SGD", 95.5, 1000, s_seconds, 573_000_000))


def test_projection_is_bytes_over_rate():
    ours, _ = _runs(30.0, 20.0)
    for rate in (100 * MBIT, GBIT):
        p = demo.project(ours, rate)
        assert p.link_step_s == pytest.approx(8 * 76_000 / rate)
        assert p.step_s == pytest.approx(0.030 + 8 * 76_000 / rate)
        assert p.run_s == pytest.approx(30.0 + 8 * 76_000_000 / rate)
        assert p.run_s == pytest.approx(p.step_s * ours.steps)


def test_make_run_takes_the_busiest_node():
    ranks = [{"bytes": {"inter": b, "intra": 7}, "steps": 10, "seconds": s, "acc": 90.0}
             for b, s in ((100, 1.0), (50, 2.0), (70, 1.5), (90, 1.2))]
    run = demo.make_run("x", ranks, procs_per_node=2)
    assert run.node_bytes == 160  # node 1 (ranks 2, 3) sent 160, node 0 150
    assert run.seconds == 2.0     # the slowest rank
    assert run.step_bytes == 16.0
    ranks[3]["steps"] = 9
    with pytest.raises(ValueError, match="different numbers of steps"):
        demo.make_run("x", ranks, procs_per_node=2)


def test_crossover_is_where_both_projections_meet():
    ours, base = _runs(30.0, 20.0)
    cross = demo.crossover_bps(ours, base)
    assert cross == pytest.approx(8 * (573e6 - 76e6) / 10.0)
    assert demo.project(ours, cross).run_s == pytest.approx(demo.project(base, cross).run_s)


def test_fewer_bytes_finish_first_below_the_crossover_only():
    ours, base = _runs(30.0, 20.0)
    cross = demo.crossover_bps(ours, base)
    slow, fast = cross / 2, cross * 2
    assert demo.project(ours, slow).run_s < demo.project(base, slow).run_s
    assert demo.project(ours, fast).run_s > demo.project(base, fast).run_s


def test_verdict_names_each_rates_winner_and_why():
    ours, base = _runs(30.0, 20.0)
    cross = demo.crossover_bps(ours, base)
    slow, fast = cross / 2, cross * 2
    lines = demo.verdict(ours, base, (slow, fast))
    assert "10.0 ms slower" in lines[0]
    assert lines[1].startswith(f"At {demo.format_rate(slow)}, ASSGD would finish first")
    assert lines[2].startswith(f"At {demo.format_rate(fast)}, synchronous fp32 SGD would finish")
    # Why: what ASSGD saves on the link, less than its extra computation (10 ms a step).
    saved_ms = 1e3 * 8 * (573_000 - 76_000) / fast
    assert f"whose {saved_ms:.1f} ms saved are less than the 10.0 ms" in lines[2]
    assert demo.format_rate(cross) in lines[3]


def test_faster_on_loopback_is_first_at_every_rate():
    cross = demo.crossover_bps(*_runs(30.0, 20.0))  # the rates around the slower's crossover
    slow, fast = cross / 2, cross * 2
    ours, base = _runs(15.0, 20.0)
    assert demo.crossover_bps(ours, base) is None
    assert all("ASSGD would finish first" in line
               for line in demo.verdict(ours, base, (slow, fast))[1:3])


def test_measured_verdict_names_the_measured_winner():
    ours, base = _runs(40.0, 90.0)
    (line,) = demo.verdict(ours, base, (), measured_at=100 * MBIT)
    assert line.startswith("On the emulated 100 Mbit/s link (measured), ASSGD finished first, "
                           "40.0 s against 90.0 s. Per step, synchronous fp32 SGD put 573,000 "
                           "bytes on each node's link, ASSGD 76,000 (7.5x fewer)")


def test_rates_parse_as_the_emulated_link_spells_them():
    assert demo.parse_rate("100mbit") == 100 * MBIT and demo.parse_rate("1gbit") == GBIT
    with pytest.raises(ValueError, match="100mbit"):
        demo.parse_rate("100 Mbit/s")


def test_a_misspelled_optimizer_names_the_nearest():
    assert demo.Config(optimizers="adamw, sgd").pairs() == [("adamw-qcomm", "adamw"),
                                                            ("assgd", "sgd")]
    with pytest.raises(ValueError, match=r"got 'sgd,adamv'; did you mean 'adamw'\?$"):
        demo.Config(optimizers="sgd,adamv").pairs()
    with pytest.raises(ValueError, match=r"got 'lion'$"):
        demo.Config(optimizers="lion").pairs()


def test_emulated_link_needs_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert any("root" in p for p in demo.emulation_problems())
    with pytest.raises(SystemExit, match="cannot run here: it needs root"):
        demo.run_emulated(demo.Config(), "100mbit", {}, 60.0)


def _floats(pattern: str, text: str) -> list[tuple[str, ...]]:
    return re.findall(pattern, text, flags=re.MULTILINE)


_METHODS = {"ASSGD", "synchronous fp32 SGD"}


@pytest.fixture(scope="module")
def report() -> dict:
    """One tiny run of the demo (4 processes, one epoch of a small model) and the figures its
    report prints, shared by the tests below."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--num-samples", "2000", "--hidden",
         "256", "--optimizers", "sgd", "--timeout-s", "240"],
        env=env, capture_output=True, text=True, timeout=280, check=False)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (steps,) = {int(s) for s in re.findall(r"after the same (\d+) steps", out)}
    return {
        "out": out, "steps": steps,
        "train_s": {m: float(s) for m, s in _floats(
            r"^(ASSGD|synchronous fp32 SGD)\b.*?%\s+[\d,]+\s+([\d.]+)$", out)},
        "totals": {m: int(b.replace(",", "")) for m, b in _floats(
            r"^(ASSGD|synchronous fp32 SGD)\b.*?%\s+([\d,]+)\s+[\d.]+$", out)},
        "per_step": {m: (float(b.replace(",", "")), float(t)) for m, b, t in _floats(
            r"^(ASSGD|synchronous fp32 SGD)\s+([\d,]+)\s+([\d.]+) ms$", out)},
        "rows": _floats(r"^(\d+ [MG]bit/s)?\s+(ASSGD|synchronous fp32 SGD)\s+([\d.]+) ms\s+"
                        r"([\d.]+) ms\s+([\d.]+) s$", out),
    }


def _projected(report: dict) -> dict[tuple[float, str], tuple[str, str, str]]:
    """(rate, method) -> the printed (link ms, step ms, run s) of the projection table, whose
    rate is printed on the first row of each rate only."""
    rate, table = None, {}
    for label, m, link_ms, step_ms, run_s in report["rows"]:
        rate = demo.parse_rate(label.replace(" ", "").replace("/s", "").lower()) if label else rate
        table[(rate, m)] = (link_ms, step_ms, run_s)
    return table


def test_demo_runs_this_checkouts_qcomm(report: dict) -> None:
    assert "warning: ranks imported qcomm" not in report["out"]


def test_demo_reports_every_figure_for_both_methods(report: dict) -> None:
    assert set(report["train_s"]) == set(report["per_step"]) == set(report["totals"]) == _METHODS
    assert len(report["rows"]) == 4


def test_bytes_per_step_are_the_busiest_nodes(report: dict) -> None:
    steps = report["steps"]
    for m, (step_bytes, _) in report["per_step"].items():
        # The busiest node's bytes: at least half of both nodes' total, at most all of it.
        total = report["totals"][m]
        assert total / 2 <= step_bytes * steps + 0.5 * steps <= total + 0.5 * steps


def test_projection_table_follows_from_the_measurements(report: dict) -> None:
    steps = report["steps"]
    for (rate, m), (link_ms, step_ms, run_s) in _projected(report).items():
        step_bytes, measured_ms = report["per_step"][m]
        assert float(link_ms) == pytest.approx(1e3 * 8 * step_bytes / rate, abs=0.051)
        # Three printed roundings of 0.05 ms each at most.
        assert float(step_ms) == pytest.approx(measured_ms + float(link_ms), abs=0.151)
        # The run: its measured seconds plus its bytes over the rate.
        assert float(run_s) == pytest.approx(
            report["train_s"][m] + 8 * step_bytes * steps / rate,
            abs=0.101 + 8 * 0.5 * steps / rate)


def test_verdict_ends_the_output_and_names_the_projected_winners(report: dict) -> None:
    out = report["out"]
    verdict = out[out.index("\nVerdict, from the numbers above:\n"):].strip().splitlines()[1:]
    # The verdict ends the output: a line on loopback, one per rate, one on the crossover rate
    # and accuracy, and nothing after it.
    assert len(verdict) == 2 + len(demo.PROJECTED_RATES)
    assert all(v.startswith("  ") for v in verdict), verdict
    run_s = {k: float(v[2]) for k, v in _projected(report).items()}
    for rate in demo.PROJECTED_RATES:
        (line,) = [v for v in verdict if v.strip().startswith(f"At {demo.format_rate(rate)},")]
        first = min(_METHODS, key=lambda m: run_s[(rate, m)])
        if run_s[(rate, "ASSGD")] != run_s[(rate, "synchronous fp32 SGD")]:
            assert f", {first} would finish first" in line, line
