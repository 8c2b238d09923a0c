"""bench/gpu_step.py's training step end to end, on CPU at tiny size: two node processes train
the transformer under every setting (the torch optimizers alone, ADAMW_SLOW_LINK, SLOW_LINK,
each again with the last node slowed), and the JSON holds every figure, sane, with n/a and its
reason where CPU has none. The prepared GPU check runs the same command at GPU size."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_step

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_step.py"
ARGV = ["--cpu", "--size", "tiny", "--warmup", "2", "--steps", "4", "--peer-delay-ms", "25",
        "--timeout-s", "40"]


class _TwoNodes:
    """The session's Gloo world of two (the ``gloo`` fixture) as ``WorldPool.run``."""

    def __init__(self, pools) -> None:
        self.pools = pools

    def run(self, fn, *, args: tuple = (), timeout_s: float = 120.0) -> list:
        return self.pools.run(fn, 2, args=args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def report(gloo, tmp_path_factory) -> tuple[dict, dict]:
    path = tmp_path_factory.mktemp("gpu_step") / "step.json"
    args = gpu_step.parse_args([*ARGV, "--json", str(path)])
    out, error = gpu_step.run(args, _TwoNodes(gloo))
    assert error is None, error
    return out, json.loads(path.read_text())


@pytest.mark.timeout(120)
def test_every_setting_trains_and_is_timed(report) -> None:
    out, written = report
    assert out["complete"] is written["complete"] is True and written["error"] is None
    assert list(written["settings"]) == gpu_step.plan(["adamw-slow-link", "slow-link"], True)
    for name, s in written["settings"].items():
        assert s["device"] == "cpu", name
        assert len(s["step_ms_per_node"]) == 2, name
        assert all(x > 0 and math.isfinite(x) for x in s["step_ms_per_node"]), (name, s)
        assert s["step_ms"] > 0 and s["step_ms_mean"] > 0, name
        assert all(c > 0 for c in s["param_change"]), (name, s["param_change"])
        assert all(math.isfinite(x) for x in s["first_loss"]), name
        assert s["copies"] == [None, None] and s["peak_bytes"] == [None, None], name
        if name.split("+")[0] in ("adamw-slow-link", "slow-link"):
            assert all(b["inter"] > 0 for b in s["bytes_sent"]), (name, s["bytes_sent"])
            assert sum(s["messages_timed"]) > 0, name
        else:
            assert s["bytes_sent"] == [None, None] and s["codec_host_ms"] == 0, name
    # The slowed node is slower than node 0 in the plain runs, where nobody waits.
    for plain in ("plain-adamw", "plain-sgd"):
        per_node = written["settings"][plain + gpu_step.SLOW]["step_ms_per_node"]
        assert per_node[1] > per_node[0] and per_node[1] >= 25, per_node


@pytest.mark.timeout(120)
def test_every_figure_is_there_with_n_a_where_cpu_has_none(report) -> None:
    _, written = report
    assert set(written["figures"]) == {"adamw-slow-link", "slow-link"}
    for name, figs in written["figures"].items():
        assert {"extra_ms", "extra_share", "codec_ms", "codec_share", "copies_dtoh",
                "copies_htod", "peak_added_mib"} <= set(figs), name
        assert figs["codec_ms"]["value"] > 0, (name, figs["codec_ms"])
        assert 0 < figs["codec_share"]["value"] < 1, (name, figs["codec_share"])
        for key in ("copies_dtoh", "copies_htod", "peak_added_mib"):
            assert figs[key]["value"] is None and "CPU" in figs[key]["why"], (name, key)
        # Targets are for CUDA: on CPU they are reported, never judged.
        assert all(f["ok"] is None for f in figs.values()), name
    assert set(written["wait"]) == {"adamw-slow-link", "slow-link"}
    assert written["peer_delay_ms"] == 25
    for figs in written["wait"].values():
        assert math.isfinite(figs["wait_ms"]["value"]) and figs["wait_share"]["ok"] is None
    assert gpu_step.missed(written) == []


@pytest.mark.timeout(120)
def test_the_table_prints_every_figure_with_its_target(report, capsys) -> None:
    out, _ = report
    gpu_step.print_table(out)
    text = capsys.readouterr().out
    assert "<= 0.05" in text and "lockstep: the control" in text
    for key in ("extra_share", "codec_share", "copies_dtoh", "peak_added_mib", "wait_share"):
        assert key in text, key


@pytest.mark.parametrize(("argv", "named"), [
    (["--nodes", "1"], "--nodes must be >= 2, got 1"),
    (["--warmup", "0"], "--warmup must be >= 1, got 0"),
    (["--settings", "slow-lnk"], "--settings must name some of"),
    (["--width", "10", "--heads", "4"], "--width (10) must be a multiple of --heads (4)"),
    (["--timeout-s", "0"], "--timeout-s must be a positive number"),
])
def test_bad_flags_are_refused_by_name(argv: list[str], named: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_step.parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_run_on_cpu_says_the_targets_are_not_judged() -> None:
    """The command itself, as gpu_check.sh runs it: exit 0, the table printed, partial JSON
    not needed (one quick setting pair without the slowed peer)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *ARGV, "--settings", "adamw-slow-link",
                           "--no-slow-peer", "--check-targets"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "extra_share" in proc.stdout and "every target is n/a" in proc.stdout, proc.stdout


class _FailsSecond(_TwoNodes):
    """Runs the first setting in the session's world, then fails as a hung setting does."""

    calls = 0

    def run(self, fn, *, args: tuple = (), timeout_s: float = 120.0) -> list:
        from qcomm.testing.multiprocess import WorldError

        self.calls += 1
        if self.calls == 2:
            raise WorldError(f"rank 0 did not finish within {timeout_s:.0f} s")
        return super().run(fn, args=args, timeout_s=timeout_s)


class _SlowFirst(_TwoNodes):
    """Runs the first setting (under a limit of its own, not the budget's: a loaded machine
    must not fail it), then sits past the budget."""

    def run(self, fn, *, args: tuple = (), timeout_s: float = 120.0) -> list:
        out = super().run(fn, args=args, timeout_s=40.0)
        time.sleep(1.5)
        return out


@pytest.mark.timeout(120)
def test_a_failed_setting_is_named_and_the_finished_ones_are_written(gloo, tmp_path) -> None:
    path = tmp_path / "step.json"
    args = gpu_step.parse_args([*ARGV, "--no-slow-peer", "--json", str(path)])
    _, error = gpu_step.run(args, _FailsSecond(gloo))
    assert error is not None and "setting adamw-slow-link failed" in error, error
    written = json.loads(path.read_text())
    assert written["complete"] is False and written["error"] == error
    assert list(written["settings"]) == ["plain-adamw"]


@pytest.mark.timeout(120)
def test_no_setting_starts_after_the_time_budget(gloo, tmp_path) -> None:
    path = tmp_path / "step.json"
    args = gpu_step.parse_args([*ARGV, "--no-slow-peer", "--settings", "slow-link",
                                "--time-budget", "1", "--json", str(path)])
    _, error = gpu_step.run(args, _SlowFirst(gloo))
    assert error == "--time-budget 1 s spent: settings not run: slow-link", error
    assert list(json.loads(path.read_text())["settings"]) == ["plain-sgd"]
