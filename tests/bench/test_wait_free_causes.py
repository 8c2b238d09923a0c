"""bench/wait_free_causes.py, tiny: its runs are deterministic, lockstep's steps are the same in
every scenario, and with messages on time the wait-free run is its own no-late oracle."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import wait_free_causes as C
from bench.cluster import workloads as W


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("causes") / "mnist1d.npz"
    W.make_data("mnist1d", path, seed=0, num_samples=600)
    return path


def _args() -> argparse.Namespace:
    return argparse.Namespace(nodes=3, steps=16, marks=[8, 16], width=16)


def test_runs_are_deterministic_and_on_time_messages_change_nothing(data) -> None:
    a = C.run("wait-free", "healthy", 0, _args(), data)
    b = C.run("wait-free", "healthy", 0, _args(), data)
    oracle = C.run("no-late", "healthy", 0, _args(), data)
    assert a["curve"] == b["curve"] == oracle["curve"]
    assert a["steps"] == [16, 16, 16]


def test_a_slow_member_takes_half_the_steps_and_lockstep_waits(data) -> None:
    slow = C.run("wait-free", "slow", 0, _args(), data)
    assert slow["steps"] == [16, 16, 8]   # the fastest took 16: the run ends there
    lockstep = C.run("lockstep", "slow", 0, _args(), data)
    assert lockstep["steps"] == [16, 16, 16]
    assert lockstep["curve"] == C.run("lockstep", "healthy", 0, _args(), data)["curve"]


def test_jittered_delays_are_drawn_from_the_seed_and_keep_each_stream_in_order(data) -> None:
    args = argparse.Namespace(nodes=3, steps=48, marks=[24, 48], width=16)
    a = C.run("wait-free", "jitter", 0, args, data)   # a message out of order would raise
    assert a["curve"] == C.run("wait-free", "jitter", 0, args, data)["curve"]
    assert a["steps"] == [48, 48, 48]
    # the same seed with the constant 6-tick delay (jitter's mean) mixes other copies
    assert a["curve"] != C.run("wait-free", "latency", 0, args, data)["curve"]


def test_the_lagged_mixing_oracles_need_the_earlier_checkout(capsys) -> None:
    with pytest.raises(SystemExit):
        C.main(["--variants", "matched", "--steps", "4", "--marks", "4", "--seeds", "1"])
    assert "--qcomm" in capsys.readouterr().err


def test_a_misspelled_variant_names_the_nearest(capsys) -> None:
    with pytest.raises(SystemExit):
        C.main(["--variants", "lockstp"])
    assert "unknown scenario or variant ['lockstp']; did you mean 'lockstep'?" in (
        capsys.readouterr().err)
