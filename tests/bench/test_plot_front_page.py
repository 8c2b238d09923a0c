"""``bench/plot_front_page.py``: the front page's figure from the recorded sweep (a PNG of the
stated size, every method under the name a user knows), from a small synthetic folder (every
method of the data in the legend, the other sweeps of the folder left alone), and a clear error
for a ``--results`` that holds no such data."""

from __future__ import annotations

import importlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
fp = importlib.import_module("bench.plot_front_page")

RECORDED_NAMES = ["qcomm SLOW_LINK", "qcomm SLOW_LINK, lockstep", "streaming DiLoCo (torchft)",
                  "DiLoCo (torchft)", "local SGD, every 32 steps", "DDP + PowerSGD hook, rank 4",
                  "PyTorch DDP"]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_recorded_sweep_gives_a_small_png(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "f.png"
    proc = subprocess.run([sys.executable, "bench/plot_front_page.py", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = out.read_bytes()
    assert _png_size(data) == (1400, 480)  # two panels: the sprint, and the whole run
    assert 20_000 < len(data) < 150_000
    # the caption says what the bold and the faint curves are, and where the data come from
    assert "Bold: the repetition with the median time to 65% test accuracy (of 3)" in proc.stdout
    assert "bench/results/2026-12-03-front/mnist1d-healthy.json" in proc.stdout
    assert "Right: the same cell run to 2400 steps of the fastest node" in proc.stdout
    assert "bench/results/2026-12-05-finish-cells/4x1-quiet-summary.json" in proc.stdout


def test_the_recorded_finish_names_each_final() -> None:
    _, sweep = fp.find_sweep(fp.DEFAULT_FINISH, "mnist1d", "4x1", "100mbit")
    lines = fp.series(sweep, "mnist1d", "4x1", "100mbit")
    assert [fp._final_label(s, "test_acc") for s in lines] == [
        "qcomm SLOW_LINK: 84.2% [83.7-84.5]", "DiLoCo (torchft): 83.7% [83.6-83.7]",
        "local SGD, every 32 steps: 83.2% [83.2-83.7]"]


def test_recorded_cell_names_every_method_as_users_know_it() -> None:
    path, sweep = fp.find_sweep(fp.DEFAULT_RESULTS, "mnist1d", "4x1", "100mbit")
    assert path.name == "mnist1d-healthy.json"
    lines = fp.series(sweep, "mnist1d", "4x1", "100mbit")
    assert [s.label.split(":")[0] for s in lines] == RECORDED_NAMES  # fastest first
    assert all(len(s.runs) == 3 and s.median and s.time_to_target for s in lines)
    assert lines[0].label == "qcomm SLOW_LINK: 4.2 s [3.8-4.6]"
    assert [s.qcomm for s in lines] == [True, True] + [False] * 5


def _curve(speed: float, top: float, n: int = 12) -> list[dict]:
    return [{"step": 10.0 * i, "time_s": i / speed, "test_acc": min(top, 0.1 + 0.07 * i)}
            for i in range(n)]


def _row(method: str, layout: str = "4x1", speed: float = 2.0, top: float = 0.8,
         status: str = "ok") -> dict:
    curve = _curve(speed, top)
    t = next((p["time_s"] for p in curve if p["test_acc"] >= 0.65), None)
    row = {"method": method, "workload": "mnist1d", "layout": layout, "rate": "100mbit",
           "status": status, "metric": "test_acc", "goal": "max", "time_to_target_s": t,
           "curve": curve, "repeats_ok": 2 if status == "ok" else 0,
           "spread": {"time_to_target_s": [t, t] if t else None},
           "per_repeat": [{"status": status, "curve": curve}, {"status": status, "curve": curve}]}
    if status != "ok":
        row.update(curve=None, time_to_target_s=None, per_repeat=[])
    return row


def _sweep(rows: list[dict], **args) -> dict:
    return {"environment": {"cpus": 2}, "args": {"workload": "mnist1d", "target": 0.65, **args},
            "targets_quality": {"mnist1d": 0.65}, "rows": rows}


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    """A results folder: one healthy sweep of the cell (five methods: two fast, one that never
    reaches the target, one unknown to the script, one whose runs all failed), plus what the
    script must pass over: the same cell with a slow node, a file that is not a sweep, and a
    row of another layout."""
    rows = [_row("ddp", speed=0.5), _row("assgd-2-h16f4-g80-m9-o5-n-ddp", speed=4.0),
            _row("torchft-diloco-h16-o10-m5", top=0.6), _row("someone-elses-method", speed=1.0),
            _row("localsgd-p8", status="timeout"), _row("ddp", layout="2x2")]
    (tmp_path / "healthy.json").write_text(json.dumps(_sweep(rows)))
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "slow.json").write_text(
        json.dumps(_sweep([_row("ddp"), _row("localsgd-p32")], slow_nodes=1)))
    (tmp_path / "notes.json").write_text(json.dumps([1, 2, 3]))
    return tmp_path


def test_every_method_of_the_data_is_in_the_legend(synthetic: Path) -> None:
    path, sweep = fp.find_sweep(synthetic, "mnist1d", "4x1", "100mbit")
    assert path == synthetic / "healthy.json"
    lines = fp.series(sweep, "mnist1d", "4x1", "100mbit")
    fig = fp.figure(lines, fp.title_of(sweep, "mnist1d", "4x1", "100mbit"), 0.65)
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        title = fig.axes[0].get_title()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert legend == [s.label for s in lines]
    assert [s.method for s in lines] == [
        "assgd-2-h16f4-g80-m9-o5-n-ddp", "someone-elses-method", "ddp",
        "torchft-diloco-h16-o10-m5", "localsgd-p8"]
    assert legend[0].startswith("qcomm SLOW_LINK, lockstep: ")
    assert legend[1].startswith("someone-elses-method: ")  # unknown: its id
    assert legend[2].startswith("PyTorch DDP: ")
    assert legend[3] == "DiLoCo (torchft): never"
    assert legend[4] == "local SGD, every 8 steps: no run finished (timeout)"
    assert title == "MNIST-1D, 4 nodes, 100 Mbit/s between nodes (emulated on 2 CPU cores)"


def test_synthetic_folder_through_the_command_line(synthetic: Path, capsys) -> None:
    out = synthetic / "img" / "f.png"
    assert fp.main(["--results", str(synthetic), "--out", str(out), "--dpi", "50",
                    "--finish", "none"]) == 0
    assert _png_size(out.read_bytes()) == (400, 225)
    said = capsys.readouterr().out
    assert "(of 2)" in said and "Right:" not in said


def test_the_finish_panel_holds_every_method_by_its_final(synthetic: Path) -> None:
    _, sweep = fp.find_sweep(synthetic, "mnist1d", "4x1", "100mbit")
    for row in sweep["rows"]:
        row["final"], row["spread"]["final"] = 0.79, [0.785, 0.795]
    lines = fp.series(sweep, "mnist1d", "4x1", "100mbit")
    fig = fp.figure(lines, "sprint", 0.65, finish=(lines, "the whole run"))
    try:
        assert len(fig.axes) == 2 and fig.axes[1].get_title() == "the whole run"
        legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        heading = fig.axes[1].get_legend().get_title().get_text()
        assert fig.axes[1].get_xscale() == "linear"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert heading == "final, median of 2 runs [min-max]"
    assert legend[0] == "qcomm SLOW_LINK, lockstep: 79.0% [78.5-79.5]"
    assert len(legend) == len(lines)


def test_a_finish_without_the_cell_is_an_error_naming_the_argument(synthetic: Path,
                                                                    capsys) -> None:
    (synthetic / "other").mkdir()
    with pytest.raises(SystemExit):
        fp.main(["--results", str(synthetic), "--finish", str(synthetic / "other"),
                 "--out", str(synthetic / "x.png")])
    assert f"--finish {synthetic / 'other'}: no rows of the cell" in capsys.readouterr().err
    assert not (synthetic / "x.png").exists()


@pytest.mark.parametrize(("where", "says"), [
    ("missing", "no such file or folder"),
    ("empty", "no rows of the cell mnist1d 4x1 100mbit in any healthy sweep under it"),
    ("notes.json", "not a sweep of bench/cluster/compare.py"),
    ("bad.json", "not a JSON file"),
])
def test_bad_results_is_an_error_naming_the_argument(synthetic: Path, capsys, where: str,
                                                      says: str) -> None:
    (synthetic / "empty").mkdir()
    (synthetic / "bad.json").write_text("{")
    target = synthetic / where
    with pytest.raises(SystemExit) as e:
        fp.main(["--results", str(target), "--out", str(synthetic / "x.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--results {target}: {says}" in err
    assert not (synthetic / "x.png").exists()


def test_two_healthy_sweeps_of_the_cell_ask_for_one_file(synthetic: Path, capsys) -> None:
    (synthetic / "again.json").write_text((synthetic / "healthy.json").read_text())
    with pytest.raises(SystemExit):
        fp.main(["--results", str(synthetic)])
    err = capsys.readouterr().err
    assert "several healthy sweeps hold the cell" in err and "again.json" in err


@pytest.mark.parametrize(("method", "name"), [
    ("ddp", "PyTorch DDP"),
    ("ddp-fp16", "ddp-fp16"),
    ("ddp-powersgd-r4", "DDP + PowerSGD hook, rank 4"),
    ("localsgd", "local SGD"),
    ("localsgd-p32", "local SGD, every 32 steps"),
    ("torchft-diloco-h32-o7-m5", "DiLoCo (torchft)"),
    ("torchft-streaming-diloco-h32-o7-m5", "streaming DiLoCo (torchft)"),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp-cont", "qcomm SLOW_LINK"),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp", "qcomm SLOW_LINK, lockstep"),
    ("assgd-2-h16f4-g80-m9-o5-n-ddp-wf", "assgd-2-h16f4-g80-m9-o5-n-ddp-wf"),
    ("assgd-4", "assgd-4"),
    ("slow-link", "qcomm SLOW_LINK"),
    ("adamw-slow-link", "qcomm ADAMW_SLOW_LINK"),
])
def test_names(method: str, name: str) -> None:
    assert fp.name_of(method)[0] == name
